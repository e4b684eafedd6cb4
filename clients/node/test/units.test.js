// Parts of the client that need no server: request building, the event queue, the
// safetensors reader, error decoding, and the packed package's protos.

import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { mkdtemp, rm, symlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';

import { Metadata } from '@grpc/grpc-js';

import { Completion, buildRequest, chatPrompt, readSafetensorsIndex } from '../index.js';
import { toSluiceError } from '../src/errors.js';
import { rpcStatusTypes, sluiceServices } from '../src/protos.js';
import { EventQueue } from '../src/queue.js';
import { toEvent } from '../src/requests.js';
import { safetensorsChunks } from '../src/safetensors.js';
import { runAdapterStream } from '../src/adapter_stream.js';
import { buildHeader } from '../src/update_weights.js';

const PACKAGE_ROOT = dirname(dirname(fileURLToPath(import.meta.url)));
const run = promisify(execFile);

async function withTempDir(body) {
  const dir = await mkdtemp(join(tmpdir(), 'sluice-node-unit-'));
  try {
    return await body(dir);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

/** A .safetensors file: 8-byte little-endian header length, JSON header, then the data. */
async function writeSafetensors(path, tensors) {
  const header = { __metadata__: { format: 'pt' } };
  const blobs = [];
  let offset = 0;
  for (const [name, { dtype, shape, data }] of Object.entries(tensors)) {
    const bytes = Buffer.from(data.buffer, data.byteOffset, data.byteLength);
    header[name] = { dtype, shape, data_offsets: [offset, offset + bytes.length] };
    blobs.push(bytes);
    offset += bytes.length;
  }
  const json = Buffer.from(JSON.stringify(header));
  const length = Buffer.alloc(8);
  length.writeBigUInt64LE(BigInt(json.length));
  await writeFile(path, Buffer.concat([length, json, ...blobs]));
}

test('buildRequest sends explicit zeros of optional fields (temperature 0 is greedy)', () => {
  const request = buildRequest([0, 5, 6], { temperature: 0, maxTokens: 4, stop: ['\n'], n: 2 });
  assert.deepEqual(request.tokenIds, { ids: [0, 5, 6] });
  assert.equal(request.sampling.temperature, 0);
  assert.deepEqual(request.stop, { maxTokens: 4, stop: ['\n'] });
  assert.equal(request.n, 2);
  assert.ok(!('topP' in request.sampling), 'unset options stay unset');
  assert.equal(buildRequest('Hi').text, 'Hi');
  assert.throws(() => buildRequest({ text: 'Hi' }), TypeError);
});

test('buildRequest makes a chat prompt of messages: extra keys as JSON, extras when given', () => {
  const messages = [
    { role: 'user', content: 'Hi' },
    { role: 'assistant', content: '', tool_calls: [{ function: { name: 'f', arguments: {} } }] },
  ];
  const { chat } = buildRequest(messages, { tools: [{ type: 'function' }], templateKwargs: { enable_thinking: false } });
  assert.deepEqual(chat.messages[0], { role: 'user', content: 'Hi', extraJson: '' });
  assert.deepEqual(JSON.parse(chat.messages[1].extraJson), { tool_calls: [{ function: { name: 'f', arguments: {} } }] });
  assert.equal(chat.toolsJson, '[{"type":"function"}]');
  assert.equal(chat.templateKwargsJson, '{"enable_thinking":false}');
  assert.ok(!('addGenerationPrompt' in chat), "unset: the server's default (true)");
  assert.equal(buildRequest(messages, { addGenerationPrompt: false }).chat.addGenerationPrompt, false);
  assert.deepEqual(chatPrompt(messages, { continueFinalMessage: true }).continueFinalMessage, true);
});

test('chatPrompt drops null keys as transformers drops None ones; other content goes as JSON', () => {
  const blocks = [{ type: 'text', text: 'Hi' }];
  const chat = chatPrompt([
    { role: 'user', content: 'Hi', tool_calls: null, name: undefined },
    { role: 'assistant', content: null, tool_calls: [{ id: 'x' }] },
    { role: 'user', content: blocks },
  ]);
  assert.deepEqual(chat.messages[0], { role: 'user', content: 'Hi', extraJson: '' });
  assert.deepEqual(JSON.parse(chat.messages[1].extraJson), { tool_calls: [{ id: 'x' }], content: null });
  assert.equal(chat.messages[1].content, '');
  assert.deepEqual(JSON.parse(chat.messages[2].extraJson), { content: blocks });
});

test('buildRequest passes the sampling surface: logitBias, allowed and bad token ids, bad words', () => {
  const surface = { allowedTokenIds: [1, 2], badWords: ['no'], badTokenIds: [9] };
  const request = buildRequest('Hi', { logitBias: { 3: -1.5 }, ...surface });
  assert.deepEqual(request.sampling, { logitBias: { 3: -1.5 }, ...surface });
  assert.deepEqual(buildRequest('Hi', { logitBias: new Map([[7, 2]]) }).sampling, { logitBias: { 7: 2 } });
  assert.deepEqual(buildRequest('Hi').sampling, {}, 'nothing set without the options');
});

test('buildRequest sets adapter, under the field name the proto gives it', () => {
  const { requestSerialize, requestDeserialize } = sluiceServices().Generation.service.Generate;
  const onTheWire = (options) => requestDeserialize(requestSerialize(buildRequest('Hi', options)));
  assert.equal(buildRequest('Hi', { adapter: 'customer-a' }).adapter, 'customer-a');
  assert.equal(onTheWire({ adapter: 'customer-a' }).adapter, 'customer-a');
  assert.equal(onTheWire({}).adapter, '', 'the base model by default');
  assert.equal(buildRequest('Hi').adapter, undefined, 'nothing set without the option');
});

test('buildRequest sets speculative only when given; false reaches the wire as a set field', () => {
  const { requestSerialize, requestDeserialize } = sluiceServices().Generation.service.Generate;
  const bytes = (options) => requestSerialize(buildRequest('Hi', options));
  assert.equal(buildRequest('Hi').speculative, undefined, 'unset: the server speculates');
  assert.equal(buildRequest('Hi', { speculative: false }).speculative, false);
  // An optional bool: false is sent (an unset field is not), so the server sees the opt-out.
  assert.ok(bytes({ speculative: false }).length > bytes({}).length);
  assert.equal(requestDeserialize(bytes({ speculative: false })).speculative, false);
  assert.equal(requestDeserialize(bytes({ speculative: true })).speculative, true);
});

test("a finished event's usage carries the speculative counts; an absent usage is all zeros", () => {
  const { responseSerialize, responseDeserialize } = sluiceServices().Generation.service.Generate;
  const usage = { promptTokens: 4, completionTokens: 9, cachedTokens: 0, proposedTokens: 12, acceptedTokens: 7 };
  const finished = { requestId: 'r', index: 0, finished: { reason: 'FINISH_REASON_LENGTH', usage } };
  const event = toEvent(responseDeserialize(responseSerialize(finished)));
  assert.deepEqual(event.usage, usage);
  const bare = toEvent({ requestId: 'r', index: 0, event: 'finished', finished: { reason: 'FINISH_REASON_STOP' } });
  assert.deepEqual(bare.usage, { promptTokens: 0, completionTokens: 0, cachedTokens: 0, proposedTokens: 0, acceptedTokens: 0 });
});

test('the Admin service has LoadAdapter and UnloadAdapter, their fields as the proto names them', () => {
  const { LoadAdapter, UnloadAdapter } = sluiceServices().Admin.service;
  const load = {
    name: 'a',
    path: '/adapters/a',
    pinned: true,
    replace: true,
    policyVersion: 3,
    inflight: 'INFLIGHT_POLICY_CONTINUE',
  };
  assert.deepEqual(LoadAdapter.requestDeserialize(LoadAdapter.requestSerialize(load)), load);
  assert.equal(UnloadAdapter.requestDeserialize(UnloadAdapter.requestSerialize({ name: 'a' })).name, 'a');
});

test('buildRequest sets one structured constraint, under the field names the proto gives it', () => {
  // Through the loaded proto and back: a misspelt field would be dropped by the encoder.
  const { requestSerialize, requestDeserialize } = sluiceServices().Generation.service.Generate;
  const onTheWire = (options) => requestDeserialize(requestSerialize(buildRequest('Hi', options))).structured;
  const schema = { type: 'object', properties: { ok: { type: 'boolean' } } };
  const fromObject = onTheWire({ jsonSchema: schema });
  assert.equal(fromObject.kind, 'jsonSchema');
  assert.deepEqual(JSON.parse(fromObject.jsonSchema), schema);
  assert.equal(onTheWire({ jsonSchema: '{"type": "integer"}' }).jsonSchema, '{"type": "integer"}', 'text as it is');
  assert.equal(onTheWire({ jsonObject: true }).kind, 'jsonObject');
  assert.equal(onTheWire({ regex: '\\d{3}' }).regex, '\\d{3}');
  assert.equal(onTheWire({ grammar: 'root ::= "a"' }).grammar, 'root ::= "a"');
  const choice = onTheWire({ choice: ['yes', 'no'] });
  assert.equal(choice.kind, 'choice');
  assert.deepEqual(choice.choice.choices, ['yes', 'no']);
  assert.equal(onTheWire({}), null, 'no constraint: unset');
  assert.ok(!('structured' in buildRequest('Hi', { jsonObject: false })), 'jsonObject false is unset');
});

test('buildRequest refuses two structured constraints, and one string as choice', () => {
  assert.throws(() => buildRequest('Hi', { regex: 'a+', choice: ['a'] }), {
    name: 'TypeError',
    message: /got regex, choice/,
  });
  assert.throws(() => buildRequest('Hi', { choice: 'yes' }), /choice: an array of strings/);
});

test('buildHeader needs exactly one source and a known in-flight policy', () => {
  assert.deepEqual(buildHeader({ checkpoint: '/c' }, { policyVersion: 3, inflight: 'abort', drainTimeoutMs: 50 }), {
    policyVersion: 3,
    inflight: 'INFLIGHT_POLICY_ABORT',
    checkpointDir: '/c',
    drainTimeoutMs: 50,
  });
  assert.equal(buildHeader({ tensors: '/t.safetensors' }).inlineTensors, true);
  assert.throws(() => buildHeader({ checkpoint: '/c', tensors: '/t' }), /exactly one source/);
  assert.throws(() => buildHeader({}), /exactly one source/);
  assert.throws(() => buildHeader({ checkpoint: '/c' }, { inflight: 'later' }), /inflight/);
});

test('EventQueue delivers pushed values, then the failure; an early exit runs onReturn once', async () => {
  const failing = new EventQueue();
  failing.push(1);
  failing.push(2);
  failing.fail(new Error('boom'));
  const seen = [];
  await assert.rejects(async () => {
    for await (const value of failing) seen.push(value);
  }, /boom/);
  assert.deepEqual(seen, [1, 2]);

  let returns = 0;
  const queue = new EventQueue(() => returns++);
  setTimeout(() => queue.push('a'), 5);
  for await (const value of queue) {
    assert.equal(value, 'a');
    break;
  }
  queue.push('ignored after the reader left');
  assert.equal(returns, 1);
  assert.ok(queue.ended);
});

test('safetensors: the index has absolute offsets and the chunks rebuild every tensor', async () => {
  await withTempDir(async (dir) => {
    const path = join(dir, 'model.safetensors');
    const weight = Float32Array.from({ length: 300 }, (_, i) => i / 7);
    const norm = Float32Array.from({ length: 5 }, (_, i) => -i);
    await writeSafetensors(path, {
      'layer.weight': { dtype: 'F32', shape: [20, 15], data: weight },
      'norm.weight': { dtype: 'F32', shape: [5], data: norm },
    });
    const index = await readSafetensorsIndex(path);
    assert.deepEqual(
      index.map(({ name, shape, end, begin }) => [name, shape, end - begin]),
      [
        ['layer.weight', [20, 15], 1200],
        ['norm.weight', [5], 20],
      ],
    );
    const chunks = [];
    for await (const { tensor } of safetensorsChunks(path, 512)) chunks.push(tensor);
    assert.deepEqual(
      chunks.map((c) => [c.name, c.offset, c.data.length, c.dtype, c.shape]),
      [
        ['layer.weight', 0, 512, 'F32', [20, 15]],
        ['layer.weight', 512, 512, undefined, undefined],
        ['layer.weight', 1024, 176, undefined, undefined],
        ['norm.weight', 0, 20, 'F32', [5]],
      ],
    );
    const rebuilt = Buffer.concat(chunks.filter((c) => c.name === 'layer.weight').map((c) => c.data));
    assert.deepEqual(new Float32Array(rebuilt.buffer, rebuilt.byteOffset, 300), weight);
  });
});

test('safetensors: a file that is not one is refused with its path named', async () => {
  await withTempDir(async (dir) => {
    const short = join(dir, 'short.safetensors');
    await writeFile(short, Buffer.from([1, 2, 3]));
    await assert.rejects(readSafetensorsIndex(short), /short\.safetensors: not a safetensors file/);
    const huge = join(dir, 'huge.safetensors');
    const length = Buffer.alloc(8);
    length.writeBigUInt64LE(1n << 40n);
    await writeFile(huge, Buffer.concat([length, Buffer.from('{}')]));
    await assert.rejects(readSafetensorsIndex(huge), /header length/);
    const outside = join(dir, 'outside.safetensors');
    const json = Buffer.from(JSON.stringify({ t: { dtype: 'F32', shape: [4], data_offsets: [0, 16] } }));
    length.writeBigUInt64LE(BigInt(json.length));
    await writeFile(outside, Buffer.concat([length, json, Buffer.alloc(8)]));
    await assert.rejects(readSafetensorsIndex(outside), /tensor t: data_offsets \[0,16\] outside the file/);
  });
});

test('toSluiceError decodes BadRequest and RetryInfo from grpc-status-details-bin', () => {
  const { Status, BadRequest, RetryInfo } = rpcStatusTypes();
  // google.protobuf.Any is built into protobufjs with its proto field names (type_url).
  const any = (type, value) => ({
    type_url: `type.googleapis.com/${type.fullName.slice(1)}`,
    value: type.encode(type.fromObject(value)).finish(),
  });
  const status = Status.encode(
    Status.fromObject({
      code: 8,
      message: 'queue full',
      details: [
        any(BadRequest, { fieldViolations: [{ field: 'n', description: 'too many' }] }),
        any(RetryInfo, { retryDelay: { seconds: 1, nanos: 500_000_000 } }),
      ],
    }),
  ).finish();
  const metadata = new Metadata();
  metadata.set('grpc-status-details-bin', Buffer.from(status));
  const error = toSluiceError({ code: 8, details: 'queue full', metadata });
  assert.equal(error.codeName, 'RESOURCE_EXHAUSTED');
  assert.equal(error.serverMessage, 'queue full');
  assert.deepEqual(error.fieldViolations, [{ field: 'n', description: 'too many' }]);
  assert.equal(error.retryDelayMs, 1500);

  const pushback = new Metadata();
  pushback.set('grpc-retry-pushback-ms', '250');
  assert.equal(toSluiceError({ code: 14, details: 'restarting', metadata: pushback }).retryDelayMs, 250);
  assert.equal(toSluiceError({ code: 14, details: 'x', metadata: new Metadata() }).retryDelayMs, null);
});

test('a packed tarball carries the sluice.v1 protos and loads them from its own copy', async () => {
  await withTempDir(async (dir) => {
    const { stdout } = await run('npm', ['pack', '--pack-destination', dir, '--json', '--ignore-scripts=false'], {
      cwd: PACKAGE_ROOT,
    });
    const [{ filename, files }] = JSON.parse(stdout);
    const paths = files.map((f) => f.path);
    for (const proto of ['proto/sluice/v1/generation.proto', 'proto/sluice/v1/admin.proto', 'proto/google/rpc/status.proto']) {
      assert.ok(paths.includes(proto), `${proto} is packed`);
    }
    await run('tar', ['-xzf', join(dir, filename), '-C', dir]);
    await symlink(join(PACKAGE_ROOT, 'node_modules'), join(dir, 'package', 'node_modules'));
    const probe =
      "import('./src/protos.js').then((p) => { console.log(p.sluiceProtoRoot()); " +
      'console.log(Object.keys(p.sluiceServices().Generation.service).join()); })';
    const loaded = await run(process.execPath, ['--input-type=module', '-e', probe], { cwd: join(dir, 'package') });
    const [root, methods] = loaded.stdout.trim().split('\n');
    assert.equal(root, join(dir, 'package', 'proto'));
    assert.equal(methods, 'Generate,GenerateStream,Cancel,Tokenize,GetServerInfo,RenderChat');
  });
});

test('routedExperts: asked for in OutputOptions, kept flat ([token, MoE layer, k]) by Completion', () => {
  assert.equal(buildRequest([0, 5], { routedExperts: true }).output.routedExperts, true);
  const tokens = { tokenIds: [7, 8], text: '', logprobs: [], topLogprobs: [], samplingSupport: [], policyVersion: 0 };
  const chunk = (routedExperts) => toEvent({ requestId: 'r', index: 0, event: 'tokens', tokens: { ...tokens, routedExperts } });
  const completion = new Completion('r');
  completion.add(chunk([1, 0, 3, 2, 4, 5, 6, 7])); // 2 tokens x 2 layers x top-2
  completion.add(chunk([2, 3, 0, 1, 5, 4, 7, 6]));
  assert.deepEqual(completion.routedExperts, [1, 0, 3, 2, 4, 5, 6, 7, 2, 3, 0, 1, 5, 4, 7, 6]);
  assert.deepEqual(chunk(undefined).routedExperts, []);
});

test('loadAdapterTensors sends the header, then every tensor chunk, through the proto', async () => {
  const { LoadAdapterStream } = sluiceServices().Admin.service;
  const written = [];
  let respond;
  const call = {
    write: (message) => {
      // Through the loaded proto and back: a misspelt field would be dropped by the encoder.
      written.push(LoadAdapterStream.requestDeserialize(LoadAdapterStream.requestSerialize(message)));
      return true;
    },
    end: () => respond(null, { adapter: { name: 'b', rank: 2 } }),
    cancel: () => {},
  };
  const start = (callback) => {
    respond = callback;
    return call;
  };
  const data = new Float32Array([1, 2, 3, 4, 5, 6]);
  const tensors = { 'base_model.model.x.lora_A.weight': { dtype: 'F32', shape: [2, 3], data } };
  const config = { r: 2, lora_alpha: 4, target_modules: ['q_proj'] };
  const adapter = await runAdapterStream(start, 'b', config, tensors, { chunkBytes: 16, policyVersion: 3 });
  assert.deepEqual(adapter, { name: 'b', rank: 2 });
  assert.equal(written[0].header.request.name, 'b');
  assert.equal(written[0].header.request.policyVersion, 3);
  assert.deepEqual(JSON.parse(written[0].header.adapterConfig), config);
  const chunks = written.slice(1).map((m) => m.tensor);
  assert.equal(chunks.length, 2); // 24 bytes in chunks of 16
  assert.deepEqual(chunks[0].shape, [2, 3]);
  assert.deepEqual(Buffer.concat(chunks.map((c) => c.data)), Buffer.from(data.buffer));
});

test('a refused loadAdapterTensors rejects with the status and stops sending', async () => {
  const written = [];
  let respond;
  const call = {
    write: (message) => {
      written.push(message);
      if (written.length === 1) {
        const details = 'header.adapter_config: not JSON';
        respond(Object.assign(new Error(details), { code: 3, details, metadata: new Metadata() }));
      }
      return true;
    },
    end: () => {},
    cancel: () => {},
  };
  const start = (callback) => {
    respond = callback;
    return call;
  };
  const data = new Float32Array(64);
  const tensors = { 'base_model.model.x.lora_A.weight': { dtype: 'F32', shape: [8, 8], data } };
  await assert.rejects(runAdapterStream(start, 'b', '{', tensors, { chunkBytes: 16 }), {
    name: 'SluiceError',
    codeName: 'INVALID_ARGUMENT',
  });
  assert.ok(written.length <= 2, `${written.length} messages sent after the refusal`);
});
