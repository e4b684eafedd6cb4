// The Node client against a live server on a tiny random checkpoint (tests/support/serve_tiny.py).
// Tests run in order on one server; those that swap weights put checkpoint A back.

import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { readFile } from 'node:fs/promises';
import { dirname } from 'node:path';
import { after, before, test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';

import { Client, SluiceError, collect, status } from '../index.js';
import { runPython, startServer } from './live_server.js';

const PROMPTS = ['The quick brown fox', 'Once upon a time', [0, 17, 42, 99, 123, 7], [0, 200, 3, 77]];
const MAX_TOKENS = 12;
const GREEDY = { maxTokens: MAX_TOKENS, temperature: 0, ignoreEos: true };
const LONG = { maxTokens: 480, temperature: 0, ignoreEos: true }; // runs until cancelled

let server;
let client;

before(async () => {
  server = await startServer();
  client = new Client(server.target, { apiToken: server.apiToken, adminToken: server.adminToken, deadlineMs: 30_000 });
});

after(async () => {
  client?.close();
  await server?.stop();
});

async function greedyIds(prompts = PROMPTS) {
  return Promise.all(prompts.map(async (prompt) => (await client.complete(prompt, GREEDY)).tokenIds));
}

/** A second client on a channel (and connection) of its own. */
function secondClient(options = {}) {
  return new Client(server.target, {
    apiToken: server.apiToken,
    channelOptions: { 'grpc.use_local_subchannel_pool': 1 },
    ...options,
  });
}

test("greedy token ids equal the Python client's for the same prompts", async () => {
  const python = await runPython('python_greedy.py', [server.target, server.apiToken], {
    prompts: PROMPTS,
    maxTokens: MAX_TOKENS,
  });
  const node = await greedyIds();
  assert.equal(node.length, PROMPTS.length);
  for (const ids of node) assert.equal(ids.length, MAX_TOKENS);
  assert.deepEqual(node, python);
});

test('promptLogprobs: started carries the scores; maxTokens 0 scores without generating', async () => {
  const prompt = PROMPTS[2];
  const options = { promptLogprobs: true, promptLogprobsStart: 2, topLogprobs: 2 };
  const scored = await client.complete(prompt, { ...options, maxTokens: 0 });
  assert.equal(scored.reason, 'LENGTH');
  assert.deepEqual(scored.tokenIds, []);
  const scores = scored.started.promptLogprobs;
  assert.equal(scores.start, 2);
  assert.equal(scores.logprobs.length, prompt.length - 2);
  assert.ok(scores.logprobs.every((lp) => lp <= 0));
  assert.equal(scores.topLogprobs.length, prompt.length - 2);
  assert.ok(scores.topLogprobs.every((top) => top.tokenIds.length === 2));
  // The same prompt scored while generating: the same scores; without the option, none.
  const generated = await client.complete(prompt, { ...options, ...GREEDY });
  assert.deepEqual(generated.started.promptLogprobs.logprobs, scores.logprobs);
  assert.equal(generated.tokenIds.length, MAX_TOKENS);
  assert.equal((await client.complete(prompt, GREEDY)).started.promptLogprobs, null);
});

test('logprobMode SAMPLED and samplingSupport: each token within its support, same tokens', async () => {
  const options = { maxTokens: 6, temperature: 1, topK: 4, seed: 9, ignoreEos: true, logprobs: true };
  const asked = await client.complete(PROMPTS[3], { ...options, logprobMode: 'SAMPLED', samplingSupport: true });
  const plain = await client.complete(PROMPTS[3], options);
  assert.deepEqual(asked.tokenIds, plain.tokenIds);
  assert.equal(asked.samplingSupport.length, 6);
  asked.tokenIds.forEach((token, i) => {
    assert.ok(asked.samplingSupport[i].includes(token));
    assert.ok(asked.samplingSupport[i].length <= 4);
    assert.ok(asked.logprobs[i] >= plain.logprobs[i]); // renormalised over the kept tokens
  });
  assert.deepEqual(plain.samplingSupport, []);
});

test('complete with n > 1 returns every sample in index order; n = 1 one Completion', async () => {
  const options = { maxTokens: 6, temperature: 1, seed: 5, ignoreEos: true };
  const samples = await client.complete(PROMPTS[2], { ...options, n: 3 });
  assert.ok(Array.isArray(samples));
  assert.deepEqual(samples.map((c) => c.index), [0, 1, 2]);
  assert.ok(samples.every((c) => c.started !== null && c.reason === 'LENGTH'));
  assert.equal(new Set(samples.map((c) => c.tokenIds.join())).size, 3, 'three samples, not one thrice');
  const one = await client.complete(PROMPTS[2], { ...options, n: 1 });
  assert.ok(!Array.isArray(one));
  assert.deepEqual(one.tokenIds, samples[0].tokenIds);
});

test('the sampling surface reaches the engine: logitBias, allowedTokenIds, badTokenIds, badWords', async () => {
  const [plain] = await greedyIds(['Hello']);
  assert.deepEqual((await client.complete('Hello', { ...GREEDY, logitBias: { 77: 100 } })).tokenIds, Array(MAX_TOKENS).fill(77));
  const allowed = [30, 31, 32, 33].filter((id) => id !== plain[0]);
  const restricted = await client.complete('Hello', { ...GREEDY, allowedTokenIds: allowed, badTokenIds: [allowed[0]] });
  assert.ok(restricted.tokenIds.every((id) => allowed.slice(1).includes(id)), String(restricted.tokenIds));
  await assert.rejects(
    client.complete('Hello', { ...GREEDY, badWords: Array(65).fill('x') }),
    (error) => error instanceof SluiceError && error.code === status.INVALID_ARGUMENT && /sampling\.bad_words/.test(error.message),
  );
});

test('generate yields started, token chunks with logprobs and version, then one finished', async () => {
  const events = [];
  for await (const event of client.generate('Hello', { ...GREEDY, logprobs: true })) events.push(event);
  assert.equal(events[0].type, 'started');
  assert.ok(events[0].promptTokens > 0);
  const chunks = events.filter((e) => e.type === 'tokens');
  const ids = chunks.flatMap((e) => e.tokenIds);
  assert.equal(ids.length, MAX_TOKENS);
  assert.equal(chunks.flatMap((e) => e.logprobs).length, MAX_TOKENS);
  assert.ok(chunks.every((e) => e.policyVersion === events[0].policyVersion));
  assert.deepEqual(events.filter((e) => e.type === 'finished').length, 1);
  const finished = events.at(-1);
  assert.equal(finished.type, 'finished');
  assert.equal(finished.reason, 'LENGTH');
  assert.equal(finished.usage.completionTokens, MAX_TOKENS);
  assert.equal(chunks.map((e) => e.text).join(''), (await client.complete('Hello', GREEDY)).text);
});

test('GenerateStream: of 8 requests the 4 cancelled end CANCELLED, the others LENGTH, each once', async () => {
  const stream = client.stream();
  const requests = Array.from({ length: 8 }, (_, i) =>
    stream.start(PROMPTS[i % PROMPTS.length], i % 2 === 0 ? LONG : GREEDY),
  );
  for (const request of requests.filter((_, i) => i % 2 === 0)) stream.cancel(request.requestId);
  stream.end();
  const outcomes = await Promise.all(
    requests.map(async (request) => {
      const events = [];
      for await (const event of request) events.push(event);
      return events;
    }),
  );
  outcomes.forEach((events, i) => {
    const finished = events.filter((e) => e.type === 'finished');
    assert.equal(finished.length, 1, `request ${i}: one finished event`);
    assert.equal(events.at(-1), finished[0], `request ${i}: finished is its last event`);
    assert.equal(finished[0].reason, i % 2 === 0 ? 'CANCELLED' : 'LENGTH', `request ${i}`);
    assert.ok(events.every((e) => e.requestId === requests[i].requestId));
  });
  await stream.closed; // an event for no request of the stream would have failed it
});

test('Cancel by id from a second client ends the request CANCELLED', async () => {
  const requestId = `node-cancel-${randomUUID()}`;
  const other = secondClient();
  try {
    let cancelled = null;
    let finished = null;
    for await (const event of client.generate('The sea was calm', { ...LONG, requestId })) {
      if (event.type === 'tokens' && cancelled === null) cancelled = await other.cancel([requestId]);
      if (event.type === 'finished') finished = event;
    }
    assert.deepEqual(cancelled, { cancelled: [requestId], notFound: [] });
    assert.equal(finished.reason, 'CANCELLED');
    assert.ok(finished.usage.completionTokens < LONG.maxTokens);
    assert.deepEqual(await other.cancel(requestId), { cancelled: [], notFound: [requestId] });
  } finally {
    other.close();
  }
});

test('a refused request is a SluiceError with its field violations decoded', async () => {
  const bad = { maxTokens: 0, temperature: Number.NaN, topP: 2 };
  const expected = [
    { field: 'sampling.temperature', description: 'must be finite (as a float32)' },
    { field: 'sampling.top_p', description: 'must be in (0, 1]' },
    { field: 'stop.max_tokens', description: 'must be >= 1 (0 only to score a prompt)' },
  ];
  const byField = (a, b) => a.field.localeCompare(b.field);
  await assert.rejects(collect(client.generate('Hello', bad)), (error) => {
    assert.ok(error instanceof SluiceError);
    assert.equal(error.code, status.INVALID_ARGUMENT);
    assert.equal(error.codeName, 'INVALID_ARGUMENT');
    assert.deepEqual([...error.fieldViolations].sort(byField), expected);
    assert.equal(error.details[0].typeUrl, 'type.googleapis.com/google.rpc.BadRequest');
    assert.equal(error.retryDelayMs, null);
    return true;
  });
  // The same refusal inside a GenerateStream: that start's reader throws, the stream goes on.
  const stream = client.stream();
  const refused = stream.start('Hello', bad);
  const fine = stream.start('Hello', GREEDY);
  stream.end();
  await assert.rejects(refused.complete(), (error) => {
    assert.ok(error instanceof SluiceError);
    assert.equal(error.code, status.INVALID_ARGUMENT);
    assert.deepEqual([...error.fieldViolations].sort(byField), expected);
    return true;
  });
  assert.equal((await fine.complete()).reason, 'LENGTH');
  await stream.closed;
});

test('Generation needs the API token: missing UNAUTHENTICATED, wrong PERMISSION_DENIED', async () => {
  for (const [apiToken, code] of [
    [undefined, status.UNAUTHENTICATED],
    ['wrong', status.PERMISSION_DENIED],
  ]) {
    const other = secondClient({ apiToken });
    try {
      await assert.rejects(other.info(), (error) => error instanceof SluiceError && error.code === code);
    } finally {
      other.close();
    }
  }
});

test('Admin is refused without its token (UNAUTHENTICATED) and the weights stay', async () => {
  const before = (await client.info()).policyVersion;
  for (const adminToken of [undefined, server.apiToken]) {
    const other = secondClient({ adminToken });
    try {
      await assert.rejects(
        other.updateWeights({ checkpoint: server.checkpointB }),
        (error) => error instanceof SluiceError && error.code === status.UNAUTHENTICATED,
      );
    } finally {
      other.close();
    }
  }
  assert.equal((await client.info()).policyVersion, before);
});

test('updateWeights from a checkpoint dir, then from a safetensors file, bumps the version each time', async () => {
  const idsA = await greedyIds();
  const version = (await client.info()).policyVersion;

  const progress = [];
  const toB = await client.updateWeights(
    { checkpoint: server.checkpointB },
    { inflight: 'drain', onProgress: (event) => progress.push(event.type) },
  );
  assert.equal(toB.previousVersion, version);
  assert.equal(toB.policyVersion, version + 1);
  assert.deepEqual([progress[0], progress.at(-1)], ['paused', 'applied']);
  assert.equal((await client.info()).policyVersion, version + 1);
  const completion = await client.complete(PROMPTS[0], GREEDY);
  assert.ok(completion.policyVersions.every((v) => v === version + 1));
  assert.notDeepEqual(await greedyIds(), idsA, 'checkpoint B generates other tokens');

  // Back to A, its tensors sent inline in 64 KiB chunks (several per large tensor).
  const toA = await client.updateWeights({ tensors: server.tensorsA }, { chunkBytes: 64 * 1024, policyVersion: version + 5 });
  assert.equal(toA.policyVersion, version + 5);
  assert.equal((await client.info()).policyVersion, version + 5);
  assert.deepEqual(await greedyIds(), idsA, "the inline tensors are A's");
});

test('updateWeights to a version not above the served one is FAILED_PRECONDITION', async () => {
  const { policyVersion } = await client.info();
  await assert.rejects(
    client.updateWeights({ tensors: server.tensorsA }, { policyVersion, chunkBytes: 4096 }),
    (error) => error instanceof SluiceError && error.code === status.FAILED_PRECONDITION,
  );
  assert.equal((await client.info()).policyVersion, policyVersion);
});

test('sleep refuses generation UNAVAILABLE with a retry delay until wake; greedy ids are unchanged', async () => {
  const before = await greedyIds(PROMPTS.slice(0, 2));
  const slept = await client.sleep({ level: 1, inflight: 'abort' });
  assert.equal(slept.level, 1);
  assert.ok(slept.releasedBytes > 0);
  try {
    assert.equal((await client.info()).state, 'SLEEPING');
    const noRetry = secondClient({ retry: false }); // the default policy would retry UNAVAILABLE
    try {
      await assert.rejects(
        noRetry.complete('The quick brown fox', GREEDY),
        (error) => error instanceof SluiceError && error.code === status.UNAVAILABLE && error.retryDelayMs > 0,
      );
    } finally {
      noRetry.close();
    }
    await assert.rejects(
      client.sleep({ level: 7 }),
      (error) => error.code === status.INVALID_ARGUMENT && error.fieldViolations[0].field === 'level',
    );
  } finally {
    const woke = await client.wake();
    assert.equal(woke.reloaded, false);
  }
  assert.equal((await client.info()).state, 'SERVING');
  assert.deepEqual(await greedyIds(PROMPTS.slice(0, 2)), before);
});

test('sleep and wake without the admin token are UNAUTHENTICATED', async () => {
  const other = secondClient({});
  try {
    await assert.rejects(other.sleep(), (error) => error.code === status.UNAUTHENTICATED);
    await assert.rejects(other.wake(), (error) => error.code === status.UNAUTHENTICATED);
  } finally {
    other.close();
  }
});

test('initWeightTransfer refuses a bad rendezvous INVALID_ARGUMENT naming the field', async () => {
  const request = { masterAddress: '127.0.0.1', masterPort: 29500, worldSize: 2, rankOffset: 0, groupName: 'g' };
  await assert.rejects(
    client.initWeightTransfer(request),
    (error) =>
      error instanceof SluiceError &&
      error.code === status.INVALID_ARGUMENT &&
      error.fieldViolations.some(({ field }) => field === 'rank_offset'),
  );
});

test('a distributed update with no group joined is FAILED_PRECONDITION and changes nothing', async () => {
  const { policyVersion } = await client.info();
  const distributed = { tensors: [{ name: 'model.norm.weight', dtype: 'F32', shape: [64] }], bucketBytes: 4096 };
  await assert.rejects(
    client.updateWeights({ distributed }),
    (error) => error instanceof SluiceError && error.code === status.FAILED_PRECONDITION && /InitWeightTransfer/.test(error.message),
  );
  assert.equal((await client.info()).policyVersion, policyVersion);
});

test('a deadline ends a long request DEADLINE_EXCEEDED', async () => {
  // The server may notice first (finished DEADLINE_EXCEEDED) or gRPC may (the call fails).
  try {
    const completion = await client.complete('The quick brown fox', { ...LONG, deadlineMs: 150 });
    assert.equal(completion.reason, 'DEADLINE_EXCEEDED');
  } catch (error) {
    assert.ok(error instanceof SluiceError, String(error));
    assert.equal(error.code, status.DEADLINE_EXCEEDED);
  }
});

test('tokenize and info describe the served model', async () => {
  const info = await client.info();
  assert.equal(info.state, 'SERVING');
  assert.equal(info.device, 'cpu');
  const ids = await client.tokenize('Hello world');
  assert.ok(ids.length > 0 && ids.every((id) => Number.isInteger(id) && id < info.vocabSize));
  const withBos = await client.tokenize('Hello world', { addSpecialTokens: true });
  assert.deepEqual(withBos.slice(1), ids);
});

test('renderChat renders with the chat template; a chat generate equals one on its token ids', async () => {
  const messages = [
    { role: 'system', content: 'Be brief.' },
    { role: 'user', content: 'The quick brown fox' },
  ];
  const rendered = await client.renderChat(messages);
  assert.equal(rendered.text, '<s>system: Be brief.</s>\nuser: The quick brown fox</s>\nassistant:');
  assert.deepEqual(rendered.tokenIds, await client.tokenize(rendered.text));
  const open = await client.renderChat(messages, { addGenerationPrompt: false });
  assert.ok(open.text.endsWith('fox</s>\n'));
  const chat = await client.complete(messages, GREEDY);
  const ids = await client.complete(rendered.tokenIds, GREEDY);
  assert.equal(chat.started.promptTokens, rendered.tokenIds.length);
  assert.deepEqual(chat.tokenIds, ids.tokenIds);
});

test('a chat message without a role is INVALID_ARGUMENT naming the field', async () => {
  await assert.rejects(client.renderChat([{ content: 'no role' }]), (error) => {
    assert.ok(error instanceof SluiceError, String(error));
    assert.equal(error.code, status.INVALID_ARGUMENT);
    assert.ok(error.fieldViolations.some((v) => v.field === 'chat.messages[0].role'), JSON.stringify(error.fieldViolations));
    return true;
  });
});

test("the README's example runs against the server", async () => {
  const packageRoot = dirname(dirname(fileURLToPath(import.meta.url)));
  const readme = await readFile(`${packageRoot}/README.md`, 'utf8');
  const [, example] = readme.match(/```js\n([\s\S]*?)```/);
  const { stdout } = await promisify(execFile)(process.execPath, ['--input-type=module', '-e', example], {
    cwd: packageRoot, // where '@sluice/client' resolves to this package
    env: { ...process.env, SLUICE_TARGET: server.target, SLUICE_API_TOKEN: server.apiToken },
    timeout: 30_000,
  });
  assert.match(stdout, /^a, policy version \d+, SERVING$/m);
  assert.match(stdout, /^\[(LENGTH|STOP)\]$/m);
  assert.match(stdout, /: LENGTH, 16 tokens$/m);
  assert.match(stdout, /: CANCELLED, \d+ tokens$/m);
  assert.match(stdout, /^INVALID_ARGUMENT \[\{"field":"sampling.temperature","description":"must be >= 0"\}\]$/m);
});

test('routedExperts on a dense model: INVALID_ARGUMENT naming output.routed_experts; moeLayers 0', async () => {
  assert.equal((await client.info()).moeLayers, 0);
  await assert.rejects(
    client.complete(PROMPTS[2], { ...GREEDY, routedExperts: true }),
    (error) => error.code === status.INVALID_ARGUMENT && error.fieldViolations[0].field === 'output.routed_experts',
  );
});

test('speculative: false is accepted; info reports the method and usage the counts (none here)', async () => {
  const info = await client.info();
  assert.equal(info.speculativeMethod, 'off'); // the test server does not speculate
  assert.equal(info.numSpeculativeTokens, 0);
  const optedOut = await client.complete(PROMPTS[2], { ...GREEDY, speculative: false });
  const plain = await client.complete(PROMPTS[2], GREEDY);
  assert.deepEqual(optedOut.tokenIds, plain.tokenIds);
  for (const completion of [optedOut, plain]) {
    assert.equal(completion.finished.usage.completionTokens, MAX_TOKENS);
    assert.equal(completion.finished.usage.proposedTokens, 0);
    assert.equal(completion.finished.usage.acceptedTokens, 0);
  }
});
