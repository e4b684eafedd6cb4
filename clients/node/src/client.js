// Client: the Generation and Admin services of one Sluice server over one channel.

import { readFileSync } from 'node:fs';

import * as grpc from '@grpc/grpc-js';

import { runAdapterStream } from './adapter_stream.js';
import { toSluiceError } from './errors.js';
import { sluiceServices } from './protos.js';
import { EventQueue } from './queue.js';
import { buildRequest, chatPrompt, collect, toEvent } from './requests.js';
import { GenerateStream } from './stream.js';
import { runUpdate } from './update_weights.js';

/**
 * The gRPC service config a Client uses unless `retry: false`: Generation calls refused with
 * RESOURCE_EXHAUSTED (queue full) or UNAVAILABLE (engine starting or restarting) are tried
 * again, up to 5 attempts, after the server's `grpc-retry-pushback-ms` when it sends one, else
 * after an exponential backoff. gRPC retries a streaming call only until its first response,
 * so no event is ever delivered twice. Admin calls are never retried.
 */
export const DEFAULT_SERVICE_CONFIG = Object.freeze({
  methodConfig: [
    {
      name: [{ service: 'sluice.v1.Generation' }],
      retryPolicy: {
        maxAttempts: 5,
        initialBackoff: '0.25s',
        maxBackoff: '4s',
        backoffMultiplier: 2,
        retryableStatusCodes: ['RESOURCE_EXHAUSTED', 'UNAVAILABLE'],
      },
    },
  ],
});

/** The metadata key a load balancer in front of several replicas hashes (docs/deploy.md). */
export const AFFINITY_KEY = 'x-sluice-affinity';
const MAX_AFFINITY_CHARS = 256;
// The largest message a Sluice server sends (a Started with the prompt logprobs of a long prompt);
// grpc-js receives at most 4 MiB by default.
const MAX_RECEIVE_MESSAGE_BYTES = 64 * 1024 * 1024;

export class Client {
  #generation;
  #admin;
  #metadata;
  #adminMetadata;
  #deadlineMs;

  /**
   * `target`: "host:port". Options: `apiToken` (Generation) and `adminToken` (Admin), sent as
   * `authorization: Bearer <token>`; `tls`: true (system roots) or {ca, cert, key} (PEM
   * Buffers or file paths; cert and key for mTLS), absent = plaintext; `retry` (default true):
   * the DEFAULT_SERVICE_CONFIG retry policy; `deadlineMs`: default deadline of every call (a
   * call's own `deadlineMs` wins); `channelOptions`: extra grpc-js channel options;
   * `affinity`: a routing key (conversation or rollout-group id) sent on every Generation call as
   * `x-sluice-affinity`, for a load balancer to send all calls with one key to one replica (a
   * call's own `affinity` wins; '' sends none). Never sent on Admin calls.
   */
  constructor(target, options = {}) {
    const { apiToken, adminToken, tls, retry = true, deadlineMs = null, channelOptions = {}, affinity } = options;
    const { Generation, Admin } = sluiceServices();
    const retryOptions = retry
      ? { 'grpc.enable_retries': 1, 'grpc.service_config': JSON.stringify(DEFAULT_SERVICE_CONFIG) }
      : { 'grpc.enable_retries': 0 };
    const limits = { 'grpc.max_receive_message_length': MAX_RECEIVE_MESSAGE_BYTES };
    this.#generation = new Generation(target, credentials(tls), { ...retryOptions, ...limits, ...channelOptions });
    this.#admin = new Admin(target, null, { channelOverride: this.#generation.getChannel() });
    this.#metadata = withAffinity(bearer(apiToken), affinity);
    this.#adminMetadata = bearer(adminToken);
    this.#deadlineMs = deadlineMs;
  }

  close() {
    this.#generation.close();
  }

  /**
   * The events of one request, as they arrive: `for await (const event of client.generate(...))`.
   * A refused or failed call throws a SluiceError; leaving the loop early cancels the call.
   */
  generate(prompt, options = {}) {
    const call = this.#generation.Generate(buildRequest(prompt, options), this.#callMetadata(options), this.#callOptions(options));
    const queue = new EventQueue(() => call.cancel());
    call.on('data', (response) => queue.push(toEvent(response)));
    call.on('error', (error) => queue.fail(toSluiceError(error)));
    call.on('status', (status) => status.code === 0 && queue.close());
    return queue;
  }

  /**
   * Runs one request to its end: its Completion when `n` is 1 (the default), the array of its
   * n Completions in index order when `n` > 1.
   */
  async complete(prompt, options = {}) {
    const samples = (await collect(this.generate(prompt, options))).sort((a, b) => a.index - b.index);
    return (options.n ?? 1) > 1 ? samples : samples[0];
  }

  /** A GenerateStream call (see GenerateStream); `deadlineMs` bounds the whole call. */
  stream(options = {}) {
    return new GenerateStream(this.#generation.GenerateStream(this.#callMetadata(options), this.#callOptions(options)));
  }

  /**
   * Cancels requests by id, from any connection: {cancelled, notFound}. Behind a load balancer
   * it reaches the replica running them only with the `affinity` they were sent with.
   */
  async cancel(requestIds, options = {}) {
    const ids = typeof requestIds === 'string' ? [requestIds] : [...requestIds];
    return this.#unary('Cancel', { requestIds: ids }, options);
  }

  async tokenize(text, options = {}) {
    const request = { text, addSpecialTokens: options.addSpecialTokens ?? false };
    return (await this.#unary('Tokenize', request, options)).tokenIds;
  }

  /**
   * The server's rendering of a chat with the model's chat template, without generating:
   * {text, tokenIds}, the prompt a generate() with these messages would use. Options: those
   * of chatPrompt (tools, addGenerationPrompt, continueFinalMessage, templateKwargs).
   */
  async renderChat(messages, options = {}) {
    const response = await this.#unary('RenderChat', { chat: chatPrompt(messages, options) }, options);
    return { text: response.text, tokenIds: response.tokenIds };
  }

  /** The served model and the engine's state; `state` is a short name ("SERVING", ...). */
  async info(options = {}) {
    const info = await this.#unary('GetServerInfo', {}, options);
    return { ...info, state: String(info.state).replace(/^SERVING_STATE_/, '') };
  }

  /**
   * Swaps the served weights: `{checkpoint: dir}` (on the server's file system),
   * `{tensors: path to a .safetensors file | {name: {dtype, shape, data}}}` sent inline, or
   * `{distributed: {tensors: [{name, dtype, shape}], bucketBytes}}`: a trainer in the group of
   * initWeightTransfer broadcasts them once the `paused` event arrives (see onProgress).
   * Options: policyVersion (0 = served + 1), inflight (drain | abort | continue | recompute),
   * drainTimeoutMs, chunkBytes (default 4 MiB), onProgress(event), deadlineMs. Resolves with the
   * applied event; rejects with a SluiceError when the server refuses or the update fails.
   */
  async updateWeights(source, options = {}) {
    const call = this.#admin.UpdateWeights(this.#adminMetadata.clone(), this.#callOptions(options));
    return runUpdate(call, source, options);
  }

  /**
   * Frees the server's KV cache and prefix cache (level 1, the default) and its weights too
   * (level 2) until `wake()`; generation is refused UNAVAILABLE meanwhile. Options: level,
   * inflight (drain | abort; default drain), drainTimeoutMs, deadlineMs. Resolves with
   * {level, aborted, releasedBytes, seconds}; rejects with a SluiceError when refused or failed.
   */
  async sleep(options = {}) {
    const request = {
      level: options.level ?? 1,
      inflight: `INFLIGHT_POLICY_${String(options.inflight ?? 'drain').toUpperCase()}`,
    };
    if (options.drainTimeoutMs !== undefined && options.drainTimeoutMs !== null) {
      request.drainTimeoutMs = options.drainTimeoutMs;
    }
    return this.#adminUnary('Sleep', request, options);
  }

  /** Serves again after `sleep()`: resolves with {reloaded, policyVersion, seconds}. */
  async wake(options = {}) {
    return this.#adminUnary('Wake', {}, options);
  }

  /**
   * Joins the server's engine to a trainer's process group, for `{distributed}` updates:
   * {masterAddress, masterPort, worldSize, rankOffset, backend ('gloo' | 'nccl'), groupName,
   * timeoutMs}, or {close: true} to leave it. Resolves with {engineRanks} once every rank has
   * joined (the trainer joins meanwhile); rejects with a SluiceError otherwise.
   */
  initWeightTransfer(request, options = {}) {
    return this.#adminUnary('InitWeightTransfer', request, options);
  }

  /**
   * Loads the PEFT LoRA adapter directory `path` (on the server's disk) as `name`; requests
   * select it with the `adapter` option. Options: pinned (never evicted from its slot),
   * replace (update the loaded `name` in place), policyVersion (its version after it; 0 = 1,
   * or with replace its version + 1), inflight (with replace: drain | abort | continue |
   * recompute, what requests running it do), deadlineMs. Resolves with its AdapterInfo;
   * rejects with a SluiceError (INVALID_ARGUMENT, ALREADY_EXISTS, NOT_FOUND,
   * FAILED_PRECONDITION, ...).
   */
  async loadAdapter(name, path, options = {}) {
    const request = {
      name,
      path,
      pinned: options.pinned ?? false,
      replace: options.replace ?? false,
      policyVersion: options.policyVersion ?? 0,
      inflight: `INFLIGHT_POLICY_${String(options.inflight ?? 'drain').toUpperCase()}`,
    };
    return (await this.#adminUnary('LoadAdapter', request, options)).adapter;
  }

  /**
   * Loads a LoRA adapter sent from here (Admin LoadAdapterStream) as `name`: `config` is its
   * adapter_config.json (an object or JSON text), `tensors` a .safetensors path or
   * {name: {dtype, shape, data}} with peft's tensor names, sent as updateWeights sends them.
   * Options: those of loadAdapter, and chunkBytes (default 4 MiB). Resolves with its
   * AdapterInfo; rejects with a SluiceError.
   */
  async loadAdapterTensors(name, config, tensors, options = {}) {
    const start = (callback) =>
      this.#admin.LoadAdapterStream(this.#adminMetadata.clone(), this.#callOptions(options), callback);
    return runAdapterStream(start, name, config, tensors, options);
  }

  /** Forgets the adapter `name`: NOT_FOUND if none is loaded, FAILED_PRECONDITION while
   * requests run it. */
  async unloadAdapter(name, options = {}) {
    await this.#adminUnary('UnloadAdapter', { name }, options);
  }

  #adminUnary(method, request, options) {
    return new Promise((resolve, reject) => {
      this.#admin[method](request, this.#adminMetadata.clone(), this.#callOptions(options), (error, response) =>
        error ? reject(toSluiceError(error)) : resolve(response),
      );
    });
  }

  #unary(method, request, options) {
    return new Promise((resolve, reject) => {
      this.#generation[method](request, this.#callMetadata(options), this.#callOptions(options), (error, response) =>
        error ? reject(toSluiceError(error)) : resolve(response),
      );
    });
  }

  /** A Generation call's metadata: the call's own `affinity` wins over the client's. */
  #callMetadata(options) {
    const metadata = this.#metadata.clone();
    if (options.affinity === undefined || options.affinity === null) return metadata;
    metadata.remove(AFFINITY_KEY);
    return withAffinity(metadata, options.affinity);
  }

  #callOptions(options) {
    const deadlineMs = options.deadlineMs ?? this.#deadlineMs;
    return deadlineMs === null || deadlineMs === undefined ? {} : { deadline: Date.now() + deadlineMs };
  }
}

function bearer(token) {
  const metadata = new grpc.Metadata();
  if (token !== undefined && token !== null) metadata.set('authorization', `Bearer ${token}`);
  return metadata;
}

/** `metadata` with the routing key set; '' or absent: none. */
export function withAffinity(metadata, affinity) {
  if (affinity === undefined || affinity === null || affinity === '') return metadata;
  if (typeof affinity !== 'string' || affinity.length > MAX_AFFINITY_CHARS || !/^[!-~]+$/.test(affinity)) {
    throw new TypeError(
      `affinity: ${JSON.stringify(String(affinity).slice(0, 40))} must be printable ASCII without spaces, at most ${MAX_AFFINITY_CHARS} characters`,
    );
  }
  metadata.set(AFFINITY_KEY, affinity);
  return metadata;
}

function credentials(tls) {
  if (!tls) return grpc.credentials.createInsecure();
  if (tls === true) return grpc.credentials.createSsl();
  return grpc.credentials.createSsl(pem(tls.ca), pem(tls.key), pem(tls.cert));
}

function pem(value) {
  if (value === undefined || value === null) return null;
  return typeof value === 'string' ? readFileSync(value) : Buffer.from(value);
}
