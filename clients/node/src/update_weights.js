// Driving one Admin.UpdateWeights call: the header, then (inline tensors) the chunks, then a
// half-close; the progress events read back until `applied`. A distributed source sends only
// the header: a trainer broadcasts the tensors over its process group once `paused` arrives.

import { once } from 'node:events';

import { toSluiceError } from './errors.js';
import { memoryChunks, safetensorsChunks } from './safetensors.js';

export const DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024;
const INFLIGHT = ['drain', 'abort', 'continue', 'recompute'];

/**
 * The UpdateWeightsHeader of an update: a checkpoint dir, inline tensors to follow, or a
 * distributed source ({tensors: [{name, dtype, shape}], bucketBytes}) a trainer broadcasts.
 */
export function buildHeader(source, { policyVersion = 0, inflight = 'drain', drainTimeoutMs } = {}) {
  const hasCheckpoint = typeof source?.checkpoint === 'string';
  const sources = [hasCheckpoint, source?.tensors !== undefined, source?.distributed !== undefined];
  if (sources.filter(Boolean).length !== 1) {
    throw new TypeError('updateWeights: give exactly one source: {checkpoint}, {tensors} or {distributed}');
  }
  if (!INFLIGHT.includes(String(inflight).toLowerCase())) {
    throw new TypeError(`updateWeights: inflight ${JSON.stringify(inflight)} is not one of ${INFLIGHT.join(', ')}`);
  }
  const header = { policyVersion, inflight: `INFLIGHT_POLICY_${inflight.toUpperCase()}` };
  if (hasCheckpoint) header.checkpointDir = source.checkpoint;
  else if (source.distributed !== undefined) header.distributed = distributedSource(source.distributed);
  else header.inlineTensors = true;
  if (drainTimeoutMs !== undefined && drainTimeoutMs !== null) header.drainTimeoutMs = drainTimeoutMs;
  return header;
}

/** A DistributedSource message: the tensor list, in broadcast order, and the bucket size. */
function distributedSource({ tensors, bucketBytes } = {}) {
  if (!Array.isArray(tensors)) throw new TypeError('updateWeights: distributed.tensors must be an array');
  const message = { tensors: tensors.map(({ name, dtype, shape }) => ({ name, dtype, shape })) };
  if (bucketBytes !== undefined && bucketBytes !== null) message.bucketBytes = bucketBytes;
  return message;
}

/** The TensorChunk messages of an inline source: a .safetensors path, or tensors in memory. */
export function tensorMessages(tensors, chunkBytes) {
  if (!(Number.isInteger(chunkBytes) && chunkBytes >= 1)) throw new RangeError('chunkBytes: an integer >= 1');
  return typeof tensors === 'string' ? safetensorsChunks(tensors, chunkBytes) : memoryChunks(tensors, chunkBytes);
}

/** A progress message as an event: {type: 'paused' | 'loading' | 'applied', ...fields}. */
function toProgress(message) {
  return { type: message.event, ...message[message.event] };
}

/**
 * Runs an update on `call` (a fresh UpdateWeights duplex call) and resolves with the applied
 * event; rejects with a SluiceError carrying the server's status when it refuses or fails.
 */
export async function runUpdate(call, source, options = {}) {
  const header = buildHeader(source, options);
  const messages = header.inlineTensors ? tensorMessages(source.tensors, options.chunkBytes ?? DEFAULT_CHUNK_BYTES) : [];
  let applied = null;
  let settled = false;
  const outcome = new Promise((resolve, reject) => {
    call.on('data', (message) => {
      const event = toProgress(message);
      if (event.type === 'applied') applied = event;
      options.onProgress?.(event);
    });
    call.on('error', (error) => reject(toSluiceError(error)));
    call.on('status', (status) => {
      if (status.code !== 0) return; // 'error' reports it
      if (applied !== null) resolve(applied);
      else reject(new Error('UpdateWeights ended without an applied event'));
    });
  }).finally(() => {
    settled = true;
  });
  const stopped = outcome.then(
    () => {},
    () => {},
  );

  await sendAll(call, { header }, messages, () => settled, stopped);
  return outcome;
}

/**
 * Writes `first`, then every message of `messages` (waiting for 'drain' when the call's buffer
 * is full), then half-closes; stops early once `isSettled()` (the server ended the call: it
 * refused). An unreadable source cancels the call and rethrows, once `stopped` has passed.
 */
export async function sendAll(call, first, messages, isSettled, stopped) {
  try {
    call.write(first);
    for await (const message of messages) {
      if (isSettled()) break; // stop reading the file: the server will not take it
      if (!call.write(message)) await Promise.race([once(call, 'drain'), stopped]);
    }
  } catch (error) {
    call.cancel(); // an unreadable file: nothing sensible was sent
    await stopped;
    throw error;
  }
  if (!isSettled()) call.end();
}
