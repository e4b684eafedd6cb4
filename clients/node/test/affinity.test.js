// The routing key (`affinity`) on the wire, against an in-process grpc-js server that records
// each call's `x-sluice-affinity` metadata.

import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';

import * as grpc from '@grpc/grpc-js';

import { AFFINITY_KEY, Client } from '../index.js';
import { sluiceServices } from '../src/protos.js';

let server;
let target;
const seen = [];

function record(call) {
  seen.push({ key: call.metadata.get(AFFINITY_KEY)[0], authorization: call.metadata.get('authorization')[0] });
}

before(async () => {
  server = new grpc.Server();
  server.addService(sluiceServices().Generation.service, {
    Generate: (call) => {
      record(call);
      call.write({ requestId: 'r', finished: { reason: 'FINISH_REASON_LENGTH' } });
      call.end();
    },
    Cancel: (call, callback) => {
      record(call);
      callback(null, { cancelled: [], notFound: call.request.requestIds });
    },
  });
  const port = await new Promise((resolve, reject) =>
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (error, bound) =>
      error ? reject(error) : resolve(bound),
    ),
  );
  target = `127.0.0.1:${port}`;
});

after(() => server?.forceShutdown());

test('the affinity key goes on every Generation call; a call\'s own wins and "" sends none', async () => {
  seen.length = 0;
  const client = new Client(target, { affinity: 'conv-1', apiToken: 't', deadlineMs: 5000 });
  try {
    await client.complete([0, 1]);
    await client.complete([0, 1], { affinity: 'conv-2' });
    await client.complete([0, 1], { affinity: '' });
    await client.cancel(['x']);
    await client.cancel(['x'], { affinity: 'group-9' });
  } finally {
    client.close();
  }
  assert.deepEqual(
    seen.map((s) => s.key),
    ['conv-1', 'conv-2', undefined, 'conv-1', 'group-9'],
  );
  assert.ok(seen.every((s) => s.authorization === 'Bearer t'));
});

test('an affinity key that cannot travel as a header value is a TypeError', () => {
  for (const bad of ['has space', 'naïve', 'x'.repeat(257)]) {
    assert.throws(() => new Client(target, { affinity: bad }), TypeError);
  }
});
