// Compiled (never run) by `tsc -p test/tsconfig.json`: the README's usage must type-check
// against index.d.ts, and misuse marked @ts-expect-error must not.
import { Client, SluiceError, collect, status, type Completion, type GenerateEvent } from '@sluice/client';

export async function usage(target: string): Promise<void> {
  const client = new Client(target, { apiToken: 't', adminToken: 'a', retry: false, deadlineMs: 5000 });
  for await (const event of client.generate('Hello', { maxTokens: 8, temperature: 0 })) {
    if (event.type === 'tokens') {
      const ids: number[] = event.tokenIds;
      const version: number = event.policyVersion;
      const support: number[][] = event.samplingSupport;
      const experts: number[] = event.routedExperts;
      void [ids, version, event.text, event.logprobs, support, experts];
    } else if (event.type === 'finished') {
      const reason: 'STOP' | 'STOP_STRING' | 'LENGTH' | 'CANCELLED' | 'DEADLINE_EXCEEDED' | 'ABORTED' | 'ERROR' | 'UNSPECIFIED' =
        event.reason;
      void [reason, event.message];
    }
  }
  const completion: Completion = await client.complete([0, 1, 2], { n: 1, seed: 7, logprobMode: 'SAMPLED', samplingSupport: true, topK: 5 });
  void completion.tokenIds;
  const withExperts = await client.complete([0, 1, 2], { routedExperts: true });
  const served = await client.info();
  const method: string = served.speculativeMethod;
  const proposal: number = served.numSpeculativeTokens;
  const optedOut = await client.complete([0, 1, 2], { speculative: false });
  if (!Array.isArray(optedOut) && optedOut.finished) {
    const { proposedTokens, acceptedTokens } = optedOut.finished.usage;
    void [method, proposal, proposedTokens / Math.max(1, acceptedTokens)];
  }
  if (!Array.isArray(withExperts)) void [withExperts.routedExperts.length / (served.moeLayers * served.expertsPerToken)];
  const scored = await client.complete([0, 1, 2], { maxTokens: 0, promptLogprobs: true, promptLogprobsStart: 1 });
  await client.complete('x', { logitBias: { 5: 1 }, allowedTokenIds: [5, 6], badWords: ['no'], badTokenIds: [6] });
  await client.complete('x', { logitBias: new Map([[5, -2]]) });
  if (!Array.isArray(scored) && scored.started?.promptLogprobs) {
    const logprobs: number[] = scored.started.promptLogprobs.logprobs;
    const promptExperts: number[] = scored.started.promptLogprobs.routedExperts;
    void [logprobs, scored.started.promptLogprobs.start, promptExperts];
  }
  const chat = [{ role: 'user', content: 'Hi' }, { role: 'tool', content: '{}', tool_call_id: 'abc123XYZ' }];
  const rendered = await client.renderChat(chat, { templateKwargs: { enable_thinking: false }, tools: [] });
  const renderedIds: number[] = rendered.tokenIds;
  void [rendered.text, renderedIds];
  void (await client.complete(chat, { addGenerationPrompt: true, continueFinalMessage: false, maxTokens: 4 }));
  const schema = { type: 'object', properties: { name: { type: 'string' } }, required: ['name'] };
  const json: Completion = await client.complete('A cat, as JSON:', { jsonSchema: schema, maxTokens: 64 });
  void json.text;
  await client.complete('x', { jsonSchema: '{"type": "integer"}' });
  await client.complete('x', { jsonObject: true });
  await client.complete('x', { regex: '[0-9]{3}' });
  await client.complete('x', { grammar: 'root ::= "yes" | "no"' });
  await client.complete(chat, { choice: ['yes', 'no'] });
  // @ts-expect-error: choice is an array of strings
  await client.complete('x', { choice: 'yes' });
  const all: Completion[] = await collect(client.generate('x', { n: 2 }));
  void all;
  const samples = await client.complete('x', { n: 3 });
  if (Array.isArray(samples)) void samples.map((sample) => sample.index);

  const routed = new Client(target, { affinity: 'conversation-1' });
  await routed.complete('Hi', { affinity: 'conversation-2', maxTokens: 1 });
  await routed.cancel(['r1'], { affinity: 'conversation-2' });
  routed.close();

  const stream = client.stream({ deadlineMs: 10_000 });
  const request = stream.start('Hi', { maxTokens: 4 });
  stream.cancel(request.requestId);
  stream.end();
  for await (const event of request) {
    const e: GenerateEvent = event;
    void e;
  }
  await stream.closed;

  const { cancelled, notFound } = await client.cancel(['a', 'b']);
  void [cancelled, notFound];
  const ids: number[] = await client.tokenize('Hello', { addSpecialTokens: true });
  void ids;
  const info = await client.info();
  const serving: boolean = info.state === 'SERVING';
  void [serving, info.kvCache.freePages];

  const applied = await client.updateWeights({ checkpoint: '/ckpt' }, { inflight: 'abort', policyVersion: 3 });
  const joined: { engineRanks: number } = await client.initWeightTransfer({ masterAddress: 'h', masterPort: 29500, worldSize: 2, rankOffset: 1, groupName: 'g' });
  await client.updateWeights({ distributed: { tensors: [{ name: 'w', dtype: 'F32', shape: [2] }], bucketBytes: 1 << 20 } });
  void joined;
  const next: number = applied.policyVersion;
  void next;
  await client.updateWeights(
    { tensors: { 'model.norm.weight': { dtype: 'F32', shape: [64], data: new Float32Array(64) } } },
    { onProgress: (p) => void (p.type === 'loading' ? p.bytesDone : 0) },
  );
  try {
    await client.info();
  } catch (error) {
    if (error instanceof SluiceError && error.code === status.INVALID_ARGUMENT) {
      for (const { field, description } of error.fieldViolations) void [field, description];
      const delay: number | null = error.retryDelayMs;
      void delay;
    }
  }

  // @ts-expect-error: exactly one source
  await client.updateWeights({ checkpoint: '/a', tensors: '/b' });
  // @ts-expect-error: a distributed source lists its tensors
  await client.updateWeights({ distributed: { bucketBytes: 1 } });
  // @ts-expect-error: not an in-flight policy
  await client.updateWeights({ checkpoint: '/a' }, { inflight: 'later' });
  // @ts-expect-error: a prompt is text or token ids
  client.generate({ text: 'x' });
  const slept = await client.sleep({ level: 2, inflight: 'abort', drainTimeoutMs: 1000 });
  const freed: number = slept.releasedBytes;
  const woke = await client.wake();
  const reloaded: boolean = woke.reloaded;
  void [freed, reloaded];
  // @ts-expect-error: sleep drains or aborts, nothing else
  await client.sleep({ inflight: 'continue' });
  const adapter = await client.loadAdapter('a', '/adapters/a', { pinned: true });
  const modules: string[] = adapter.targetModules;
  const replaced = await client.loadAdapter('a', '/adapters/a2', { replace: true, inflight: 'abort' });
  const adapterVersion: number = replaced.policyVersion;
  void adapterVersion;
  const streamed = await client.loadAdapterTensors(
    'b',
    { r: 8, lora_alpha: 16, target_modules: ['q_proj'] },
    { 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight': { dtype: 'F32', shape: [8, 64], data: new Float32Array(512) } },
    { chunkBytes: 1024, policyVersion: 3 },
  );
  const streamedRank: number = streamed.rank;
  void streamedRank;
  await client.unloadAdapter('a');
  const loaded: string[] = (await client.info()).adapters.map((a) => a.name);
  void [modules, loaded];
  await client.complete('Hi', { adapter: 'a' });
  // @ts-expect-error: an adapter is named by a string
  await client.complete('Hi', { adapter: 1 });
  client.close();
}
