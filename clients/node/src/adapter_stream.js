// Driving one Admin.LoadAdapterStream call: the header (the LoadAdapter fields and the
// adapter's config), then the tensors' chunks as UpdateWeights sends them, then a half-close;
// the response is the loaded adapter's AdapterInfo.

import { toSluiceError } from './errors.js';
import { DEFAULT_CHUNK_BYTES, sendAll, tensorMessages } from './update_weights.js';

/**
 * The LoadAdapterStreamHeader: the adapter's name and options, and its adapter_config.json
 * (an object, sent as JSON, or JSON text as it is).
 */
export function buildAdapterHeader(name, config, options = {}) {
  const adapterConfig = typeof config === 'string' ? config : JSON.stringify(config);
  const request = {
    name,
    pinned: options.pinned ?? false,
    replace: options.replace ?? false,
    policyVersion: options.policyVersion ?? 0,
    inflight: `INFLIGHT_POLICY_${String(options.inflight ?? 'drain').toUpperCase()}`,
  };
  return { request, adapterConfig };
}

/**
 * Runs a load on `start(callback)` (which opens the client-streaming call) and resolves with
 * the AdapterInfo; rejects with a SluiceError when the server refuses it.
 */
export async function runAdapterStream(start, name, config, tensors, options = {}) {
  const header = buildAdapterHeader(name, config, options);
  const messages = tensorMessages(tensors, options.chunkBytes ?? DEFAULT_CHUNK_BYTES);
  let settled = false;
  let call;
  const outcome = new Promise((resolve, reject) => {
    call = start((error, response) => {
      settled = true;
      if (error) reject(toSluiceError(error));
      else resolve(response.adapter);
    });
  });
  const stopped = outcome.then(
    () => {},
    () => {},
  );
  await sendAll(call, { header }, messages, () => settled, stopped);
  return outcome;
}
