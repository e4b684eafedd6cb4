// The default service config's retry policy against a live server overloaded on purpose:
// one running request and a waiting queue of 4, so a burst of 8 is partly refused
// RESOURCE_EXHAUSTED (with RetryInfo); gRPC's retries get every request of the burst through.

import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';

import { Client, SluiceError, status } from '../index.js';
import { startServer } from './live_server.js';

const BURST = 8;
const REQUEST = { maxTokens: 16, temperature: 0, ignoreEos: true };

let server;

before(async () => {
  server = await startServer('--max-num-seqs', '1', '--max-waiting', '4');
});

after(async () => {
  await server?.stop();
});

async function burst(retry) {
  const client = new Client(server.target, { apiToken: server.apiToken, retry, deadlineMs: 30_000 });
  try {
    const prompts = Array.from({ length: BURST }, (_, i) => [0, 10 + i, 20 + i, 30 + i]);
    return await Promise.allSettled(prompts.map((prompt) => client.complete(prompt, REQUEST)));
  } finally {
    client.close();
  }
}

test('without retries a burst is partly refused RESOURCE_EXHAUSTED with a retry delay', async () => {
  const results = await burst(false);
  const refused = results.filter((r) => r.status === 'rejected').map((r) => r.reason);
  assert.ok(refused.length > 0, 'the burst overflows the waiting queue');
  for (const error of refused) {
    assert.ok(error instanceof SluiceError, String(error));
    assert.equal(error.code, status.RESOURCE_EXHAUSTED);
    assert.ok(error.retryDelayMs > 0);
  }
  assert.ok(results.some((r) => r.status === 'fulfilled' && r.value.reason === 'LENGTH'));
});

test('with the default retry policy the same burst completes fully', async () => {
  const results = await burst(true);
  const outcomes = results.map((r) => (r.status === 'fulfilled' ? r.value.reason : r.reason.message));
  assert.deepEqual(outcomes, Array(BURST).fill('LENGTH'));
  for (const { value } of results) assert.equal(value.tokenIds.length, REQUEST.maxTokens);
});
