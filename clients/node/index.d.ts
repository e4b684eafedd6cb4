// Types of @sluice/client (the implementation is plain ESM JavaScript under src/).

import type { ChannelOptions, Metadata, status } from '@grpc/grpc-js';

export { status } from '@grpc/grpc-js';

/**
 * A prompt: text (tokenized by the server, with special tokens such as BOS), token ids, or a
 * chat: messages rendered by the server with the model's chat template.
 */
export type Prompt = string | readonly number[] | Uint32Array | readonly ChatMessage[];

/** One turn of a chat; keys besides role and content (tool_calls, tool_call_id, ...) reach the template. */
export interface ChatMessage {
  role: string;
  content?: string;
  [key: string]: unknown;
}

/** The extras of a chat prompt (GenerateOptions of a chat, and renderChat's options). */
export interface ChatOptions {
  /** Tool definitions for the template's `tools` (sent as JSON). */
  tools?: readonly unknown[];
  /** End with an assistant turn's header; default true (the server's). */
  addGenerationPrompt?: boolean;
  /** Leave the final message open for the model to continue; default false. */
  continueFinalMessage?: boolean;
  /** Extra template variables, e.g. {enable_thinking: false} (sent as a JSON object). */
  templateKwargs?: Record<string, unknown>;
}

/**
 * A constraint on the completion's text (GenerateRequest.structured): at most one of these
 * (two are a TypeError). See StructuredOutput in proto/sluice/v1/generation.proto.
 */
export interface StructuredOptions {
  /** A JSON Schema the completion is valid under: an object (sent as JSON) or JSON text. */
  jsonSchema?: Readonly<Record<string, unknown>> | string;
  /** true: the completion is any JSON object (false: unset). */
  jsonObject?: boolean;
  /** A regular expression the whole completion matches (no lookaround or backreferences). */
  regex?: string;
  /** A GBNF grammar; the completion is derived from its rule `root`. */
  grammar?: string;
  /** The completion is exactly one of these strings. */
  choice?: readonly string[];
}

/** The server's rendering of a chat. */
export interface RenderedChat {
  text: string;
  tokenIds: number[];
}

export interface ClientOptions {
  /** Sent on Generation calls as `authorization: Bearer <apiToken>`. */
  apiToken?: string;
  /** Sent on Admin calls as `authorization: Bearer <adminToken>`. */
  adminToken?: string;
  /** true: TLS with the system roots; an object: PEM Buffers or file paths (cert + key = mTLS). */
  tls?: boolean | TlsOptions;
  /** The default retry policy (DEFAULT_SERVICE_CONFIG); default true. */
  retry?: boolean;
  /** Default deadline of every call, in milliseconds from its start; a call's own wins. */
  deadlineMs?: number | null;
  /** Extra grpc-js channel options (they win over the client's own). */
  channelOptions?: ChannelOptions;
  /**
   * Routing key sent on every Generation call as `x-sluice-affinity` (a conversation or
   * rollout-group id): a load balancer sends all calls with one key to one replica. Printable
   * ASCII without spaces, at most 256 characters (else a TypeError). Never sent on Admin calls.
   */
  affinity?: string;
}

export interface TlsOptions {
  ca?: Buffer | string;
  cert?: Buffer | string;
  key?: Buffer | string;
}

export interface CallOptions {
  /** Deadline in milliseconds from the call's start. */
  deadlineMs?: number | null;
}

/** Options of a Generation call. */
export interface RoutedCallOptions extends CallOptions {
  /** This call's routing key (wins over the client's; '' sends none). */
  affinity?: string | null;
}

/** GenerateRequest fields (unset: the server's default). See proto/sluice/v1/generation.proto. */
export interface GenerateOptions extends RoutedCallOptions, ChatOptions, StructuredOptions {
  requestId?: string;
  maxTokens?: number;
  minTokens?: number;
  temperature?: number;
  topP?: number;
  topK?: number;
  minP?: number;
  frequencyPenalty?: number;
  presencePenalty?: number;
  repetitionPenalty?: number;
  seed?: number | string;
  /** Token id -> a bias added to its logit before penalties and temperature; at most 300
   * entries, biases in [-100, 100]. */
  logitBias?: Readonly<Record<number, number>> | ReadonlyMap<number, number>;
  /** Only these token ids may be sampled (at most 1024). */
  allowedTokenIds?: readonly number[];
  /** Strings never generated (tokenized by the server, alone and after a space); at most 64. */
  badWords?: readonly string[];
  /** Token ids never sampled (at most 1024). */
  badTokenIds?: readonly number[];
  stop?: readonly string[];
  stopTokenIds?: readonly number[];
  ignoreEos?: boolean;
  includeStopStrInOutput?: boolean;
  logprobs?: boolean;
  topLogprobs?: number;
  rawLogprobs?: boolean;
  skipSpecialTokens?: boolean;
  /** Score the prompt: the `started` event carries `promptLogprobs`; with maxTokens 0 (and
   * n 1) nothing is generated. */
  promptLogprobs?: boolean;
  /** The first prompt position scored, in [1, prompt length]; default 1. */
  promptLogprobsStart?: number;
  /** Which distribution logprobs come from; default PROCESSED (RAW with rawLogprobs). */
  logprobMode?: 'RAW' | 'PROCESSED' | 'SAMPLED';
  /** Return, per token, the ids it could have been drawn from (needs topK with truncation). */
  samplingSupport?: boolean;
  /** Mixture-of-experts models: return, per token, each MoE layer's routed experts
   * (TokensEvent.routedExperts); a dense model refuses it. */
  routedExperts?: boolean;
  n?: number;
  minPolicyVersion?: number;
  priority?: number;
  /** A LoRA adapter the server has loaded (loadAdapter; ServerInfo.adapters), by name; '' or
   * unset: the base model. NOT_FOUND when none of that name is loaded. */
  adapter?: string;
  /** false: the server proposes nothing for this request when it decodes speculatively
   * (ServerInfo.speculativeMethod); the tokens are the same either way. Unset: true. */
  speculative?: boolean;
}

export type FinishReason =
  | 'UNSPECIFIED'
  | 'STOP'
  | 'STOP_STRING'
  | 'LENGTH'
  | 'CANCELLED'
  | 'DEADLINE_EXCEEDED'
  | 'ABORTED'
  | 'ERROR';

interface EventBase {
  requestId: string;
  /** Which of the n samples. */
  index: number;
}

export interface StartedEvent extends EventBase {
  type: 'started';
  promptTokens: number;
  cachedTokens: number;
  policyVersion: number;
  /** The prompt's scores when `promptLogprobs` was asked for, else null. */
  promptLogprobs: PromptLogprobs | null;
}

export interface PromptLogprobs {
  /** The first prompt position scored. */
  start: number;
  /** logprobs[i]: the log-probability of prompt token start + i given those before it. */
  logprobs: number[];
  /** The `topLogprobs` most likely tokens at each scored position (empty unless asked for). */
  topLogprobs: { tokenIds: number[]; logprobs: number[] }[];
  /** With routedExperts: the experts each MoE layer chose at the position before each scored
   * one, flattened [scored position, MoE layer, k]; else empty. */
  routedExperts: number[];
}

export interface TokensEvent extends EventBase {
  type: 'tokens';
  tokenIds: number[];
  /** The text these tokens complete; may be empty while a character is incomplete. */
  text: string;
  /** logprobs[i] belongs to tokenIds[i] (when requested). */
  logprobs: number[];
  topLogprobs: { tokenIds: number[]; logprobs: number[] }[];
  /** samplingSupport[i]: the ids tokenIds[i] could have been drawn from ([]: every token). */
  samplingSupport: number[][];
  /** With routedExperts: the experts each MoE layer chose per token, flattened [token, MoE
   * layer, k] (ServerInfo.moeLayers x expertsPerToken ids per token, highest weight first);
   * else empty. */
  routedExperts: number[];
  /** The weights version that produced these tokens. */
  policyVersion: number;
}

export interface FinishedEvent extends EventBase {
  type: 'finished';
  reason: FinishReason;
  /** Why the request failed (reasons ERROR and ABORTED). */
  message: string;
  matchedStop: string;
  usage: Usage;
  versionSpans: { policyVersion: number; start: number; end: number }[];
}

/** A sample's token counts. */
export interface Usage {
  promptTokens: number;
  completionTokens: number;
  cachedTokens: number;
  /** Speculative decoding: tokens proposed for the sample and checked by the model; 0 when the
   * server does not speculate or the request opted out (speculative: false). */
  proposedTokens: number;
  /** Of proposedTokens, those the model accepted (each a token without a forward pass of its own). */
  acceptedTokens: number;
}

export type GenerateEvent = StartedEvent | TokensEvent | FinishedEvent;

export interface FieldViolation {
  field: string;
  description: string;
}

/** A call that ended with a non-OK status, or a GenerateStream start the server refused. */
export class SluiceError extends Error {
  name: 'SluiceError';
  /** The gRPC status code (compare with `status.RESOURCE_EXHAUSTED` etc.). */
  code: status;
  /** The code's name, e.g. "INVALID_ARGUMENT". */
  codeName: string;
  /** The server's message (`message` is prefixed with the code name). */
  serverMessage: string;
  /** Every google.rpc.Status detail, decoded (unknown types: their raw `value`). */
  details: ({ typeUrl: string } & Record<string, unknown>)[];
  /** From google.rpc.BadRequest (INVALID_ARGUMENT). */
  fieldViolations: FieldViolation[];
  /** From google.rpc.RetryInfo, else the grpc-retry-pushback-ms trailer; null when absent. */
  retryDelayMs: number | null;
  /** The call's trailers (null for a GenerateStream refusal). */
  metadata: Metadata | null;
  constructor(fields: {
    code: status;
    message: string;
    details?: ({ typeUrl: string } & Record<string, unknown>)[];
    fieldViolations?: FieldViolation[];
    retryDelayMs?: number | null;
    metadata?: Metadata | null;
  });
}

export function codeName(code: number): string;

/** Everything one sample streamed back, put together. */
export class Completion {
  requestId: string;
  index: number;
  started: StartedEvent | null;
  tokenIds: number[];
  text: string;
  logprobs: number[];
  /** One per token, with the samplingSupport option. */
  samplingSupport: number[][];
  /** With the routedExperts option: flattened [token, MoE layer, k]. */
  routedExperts: number[];
  /** One per token. */
  policyVersions: number[];
  finished: FinishedEvent | null;
  /** The finish reason, or "" while running. */
  readonly reason: FinishReason | '';
  add(event: GenerateEvent): void;
}

/** Reads events to their end: one Completion per (request id, index). */
export function collect(events: AsyncIterable<GenerateEvent>): Promise<Completion[]>;

/** The GenerateRequest message (proto-loader's camelCase form) for a prompt and options. */
export function buildRequest(prompt: Prompt, options?: GenerateOptions): Record<string, unknown>;

/** The ChatPrompt message (proto-loader's camelCase form) for chat messages and options. */
export function chatPrompt(messages: readonly ChatMessage[], options?: ChatOptions): Record<string, unknown>;

export class GenerateStream {
  /** Settles when the call ends; rejects with the call's SluiceError. */
  readonly closed: Promise<void>;
  /** Sends a request (an id is made up when options.requestId is not given). */
  start(prompt: Prompt, options?: Omit<GenerateOptions, 'deadlineMs'>): StreamRequest;
  /** Cancels one request of this stream by id. */
  cancel(requestId: string): void;
  /** Half-closes: the call ends once every started request has. */
  end(): void;
  /** Ends the whole call now. */
  abort(): void;
}

/** One request of a GenerateStream; iterating it yields its events, then ends (or throws). */
export class StreamRequest implements AsyncIterable<GenerateEvent> {
  readonly stream: GenerateStream;
  readonly requestId: string;
  /** Which start of its stream this is, counting from 0. */
  readonly startIndex: number;
  [Symbol.asyncIterator](): AsyncIterator<GenerateEvent>;
  cancel(): void;
  /** The Completion of sample 0. */
  complete(): Promise<Completion>;
}

export type ServingState = 'UNSPECIFIED' | 'STARTING' | 'SERVING' | 'UPDATING_WEIGHTS' | 'RESTARTING' | 'DRAINING' | 'SLEEPING';

export interface ServerInfo {
  model: string;
  maxModelLen: number;
  vocabSize: number;
  policyVersion: number;
  eosTokenIds: number[];
  device: string;
  dtype: string;
  state: ServingState;
  kvCache: {
    pageSize: number;
    totalPages: number;
    freePages: number;
    cachedPages: number;
    prefixCacheHitRatio: number;
  };
  running: number;
  waiting: number;
  /** The loaded LoRA adapters, in load order. */
  adapters: AdapterInfo[];
  /** Mixture-of-experts models: the routed layers (0 for a dense model) and the experts per
   * token in each; they unflatten TokensEvent.routedExperts. */
  moeLayers: number;
  expertsPerToken: number;
  /** The engine's tensor-parallel ranks (--tensor-parallel-size): the ranks it joins a
   * trainer's weight-transfer group with. */
  tensorParallelSize: number;
  /** Speculative decoding (--speculative-method): 'off', 'ngram', 'suffix' or 'draft'. */
  speculativeMethod: string;
  /** The most tokens proposed per request per step (--num-speculative-tokens); 0 when 'off'. */
  numSpeculativeTokens: number;
}

/** One loaded LoRA adapter (Admin LoadAdapter). */
export interface AdapterInfo {
  name: string;
  /** The adapter directory on the server's disk. */
  path: string;
  rank: number;
  /** Among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj. */
  targetModules: string[];
  pinned: boolean;
  /** Holds one of the engine's --max-loras slots now. */
  resident: boolean;
  /** lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA. */
  scaling: number;
  /** Its policy version: its requests' tokens carry it; their minPolicyVersion compares with it. */
  policyVersion: number;
}

export interface LoadAdapterOptions extends CallOptions {
  /** Never evicted from its slot (ignored with replace). */
  pinned?: boolean;
  /** Update the adapter loaded under this name in place, all or nothing. */
  replace?: boolean;
  /** The adapter's version after it: 0 = 1, or with replace its version + 1. */
  policyVersion?: number;
  /** With replace: what requests running the adapter do. Default drain. */
  inflight?: InflightPolicy;
}

export interface LoadAdapterTensorsOptions extends LoadAdapterOptions {
  /** Bytes per TensorChunk; default 4 MiB. */
  chunkBytes?: number;
}

export interface CancelResult {
  cancelled: string[];
  notFound: string[];
}

export type InflightPolicy = 'drain' | 'abort' | 'continue' | 'recompute';

/** A tensor held in memory: raw row-major little-endian bytes of the served dtype. */
export interface InlineTensor {
  dtype: 'F32' | 'F16' | 'BF16';
  shape: readonly number[];
  data: ArrayBufferView;
}

export type WeightsSource =
  | { checkpoint: string; tensors?: undefined; distributed?: undefined }
  | { tensors: string | Record<string, InlineTensor>; checkpoint?: undefined; distributed?: undefined }
  | { distributed: DistributedSource; checkpoint?: undefined; tensors?: undefined };

/** Tensors a trainer broadcasts over the group of initWeightTransfer, in this order. */
export interface DistributedSource {
  tensors: { name: string; dtype: 'F32' | 'F16' | 'BF16'; shape: number[] }[];
  /** The most bytes a bucket holds; default 1 GiB. */
  bucketBytes?: number;
}

/** A trainer's rendezvous for initWeightTransfer, or {close: true} to leave the group. */
export interface InitWeightTransferRequest {
  masterAddress?: string;
  masterPort?: number;
  worldSize?: number;
  /** The group rank of the engine's tensor-parallel rank 0 (>= 1). */
  rankOffset?: number;
  backend?: 'gloo' | 'nccl';
  groupName?: string;
  /** Default 60000, at most the server's --stall-timeout. */
  timeoutMs?: number;
  close?: boolean;
}

export type UpdateProgress =
  | { type: 'paused'; inFlight: number }
  | { type: 'loading'; bytesDone: number; bytesTotal: number; tensorsDone: number; tensorsTotal: number }
  | AppliedEvent;

export interface AppliedEvent {
  type: 'applied';
  previousVersion: number;
  policyVersion: number;
  aborted: number;
  continued: number;
  recomputed: number;
  seconds: number;
}

export interface UpdateWeightsOptions extends CallOptions {
  /** Must exceed the served version; 0 (default) = served + 1. */
  policyVersion?: number;
  inflight?: InflightPolicy;
  drainTimeoutMs?: number;
  /** Bytes per TensorChunk for inline tensors; default 4 MiB. */
  chunkBytes?: number;
  onProgress?: (event: UpdateProgress) => void;
}

/** The gRPC service config used unless `retry: false`. */
/** 'x-sluice-affinity': the metadata key of the routing key. */
export const AFFINITY_KEY: 'x-sluice-affinity';

export const DEFAULT_SERVICE_CONFIG: {
  readonly methodConfig: readonly {
    name: readonly { service: string; method?: string }[];
    retryPolicy: {
      maxAttempts: number;
      initialBackoff: string;
      maxBackoff: string;
      backoffMultiplier: number;
      retryableStatusCodes: readonly string[];
    };
  }[];
};

export class Client {
  constructor(target: string, options?: ClientOptions);
  close(): void;
  /** The events of one request; a refusal or failure throws SluiceError; break cancels. */
  generate(prompt: Prompt, options?: GenerateOptions): AsyncIterable<GenerateEvent>;
  /** Runs one request to its end: its Completion (n = 1, the default). */
  complete(prompt: Prompt, options?: GenerateOptions & { n?: 1 }): Promise<Completion>;
  /** n > 1: its n Completions in index order (an array); n = 1: one Completion. */
  complete(prompt: Prompt, options: GenerateOptions & { n: number }): Promise<Completion | Completion[]>;
  stream(options?: RoutedCallOptions): GenerateStream;
  /** Behind a load balancer, reaches the replica running them only with their `affinity`. */
  cancel(requestIds: string | readonly string[], options?: RoutedCallOptions): Promise<CancelResult>;
  tokenize(text: string, options?: RoutedCallOptions & { addSpecialTokens?: boolean }): Promise<number[]>;
  /** RenderChat: the chat template's text and token ids for these messages, without generating. */
  renderChat(messages: readonly ChatMessage[], options?: RoutedCallOptions & ChatOptions): Promise<RenderedChat>;
  info(options?: RoutedCallOptions): Promise<ServerInfo>;
  updateWeights(source: WeightsSource, options?: UpdateWeightsOptions): Promise<AppliedEvent>;
  /** Admin Sleep: frees the KV cache (level 1) and the weights too (level 2) until wake(). */
  sleep(options?: SleepOptions): Promise<SleepResult>;
  /** Admin Wake: serves again after sleep(). */
  wake(options?: CallOptions): Promise<WakeResult>;
  /** Admin LoadAdapter: loads a PEFT adapter directory on the server's disk as `name`. */
  loadAdapter(name: string, path: string, options?: LoadAdapterOptions): Promise<AdapterInfo>;
  /** Admin LoadAdapterStream: loads an adapter sent from here: its adapter_config.json (an
   * object or JSON text) and its tensors by peft's names (a .safetensors path, or in memory). */
  loadAdapterTensors(
    name: string,
    config: Record<string, unknown> | string,
    tensors: string | Record<string, InlineTensor>,
    options?: LoadAdapterTensorsOptions,
  ): Promise<AdapterInfo>;
  /** Admin UnloadAdapter: forgets the adapter `name`. */
  unloadAdapter(name: string, options?: CallOptions): Promise<void>;
  /** Resolves once every rank of the group has joined (the trainer joins meanwhile). */
  initWeightTransfer(request: InitWeightTransferRequest, options?: CallOptions): Promise<{ engineRanks: number }>;
}

export interface SleepOptions extends CallOptions {
  /** 1 (default): KV cache and prefix cache; 2: the weights too. */
  level?: 1 | 2;
  /** Admitted requests finish first (drain, the default) or end ABORTED (abort). */
  inflight?: 'drain' | 'abort';
  /** drain only: fail (ABORTED, nothing freed) after this long. */
  drainTimeoutMs?: number;
}

export interface SleepResult {
  /** The level the server sleeps at now. */
  level: number;
  /** Requests ended ABORTED (inflight abort). */
  aborted: number;
  /** Bytes this call freed. */
  releasedBytes: number;
  seconds: number;
}

export interface WakeResult {
  /** The weights were read again (waking from level 2). */
  reloaded: boolean;
  policyVersion: number;
  seconds: number;
}

/** The tensors of a .safetensors file: names, dtypes, shapes and absolute byte ranges. */
export function readSafetensorsIndex(
  path: string,
): Promise<{ name: string; dtype: string; shape: number[]; begin: number; end: number }[]>;
