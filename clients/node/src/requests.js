// GenerateRequest messages from options, and GenerateResponse messages as events.

/** A GenerateRequest (proto-loader's camelCase form); unset options leave fields unset. */
export function buildRequest(prompt, options = {}) {
  const sampling = pick(options, [
    'temperature',
    'topP',
    'topK',
    'minP',
    'frequencyPenalty',
    'presencePenalty',
    'repetitionPenalty',
    'seed',
  ]);
  // The sampling surface: logitBias maps token ids to biases ({ 50256: -100 } or a Map).
  if (options.logitBias !== undefined && options.logitBias !== null) {
    const entries = options.logitBias instanceof Map ? [...options.logitBias] : Object.entries(options.logitBias);
    sampling.logitBias = Object.fromEntries(entries.map(([id, bias]) => [String(id), bias]));
  }
  for (const name of ['allowedTokenIds', 'badWords', 'badTokenIds']) {
    if (options[name] !== undefined && options[name] !== null) sampling[name] = [...options[name]];
  }
  const stop = pick(options, ['maxTokens', 'minTokens', 'ignoreEos', 'includeStopStrInOutput']);
  if (options.stop !== undefined) stop.stop = [...options.stop];
  if (options.stopTokenIds !== undefined) stop.stopTokenIds = [...options.stopTokenIds];
  const output = pick(options, [
    'logprobs',
    'topLogprobs',
    'rawLogprobs',
    'skipSpecialTokens',
    'promptLogprobs',
    'promptLogprobsStart',
    'samplingSupport',
    'routedExperts',
  ]);
  if (options.logprobMode !== undefined) output.logprobMode = `LOGPROB_MODE_${String(options.logprobMode).toUpperCase()}`;
  const request = {
    requestId: options.requestId ?? '',
    sampling,
    stop,
    output,
    ...pick(options, ['n', 'minPolicyVersion', 'priority', 'adapter', 'speculative']),
  };
  const structured = structuredOutput(options);
  if (structured !== null) request.structured = structured;
  if (typeof prompt === 'string') {
    request.text = prompt;
  } else if (isChat(prompt)) {
    request.chat = chatPrompt(prompt, options);
  } else if (Array.isArray(prompt) || ArrayBuffer.isView(prompt)) {
    request.tokenIds = { ids: Array.from(prompt) };
  } else {
    throw new TypeError('prompt: a string, an array of token ids or an array of chat messages');
  }
  return request;
}

/** One ChatMessage: text content in `content`, any other content and extra keys in extraJson. */
function chatMessage({ role, content, ...rest }) {
  const extra = Object.fromEntries(Object.entries(rest).filter(([, v]) => v !== null && v !== undefined));
  const text = typeof content === 'string';
  if (!text) extra.content = content ?? null;
  return {
    role: role ?? '',
    content: text ? content : '',
    extraJson: Object.keys(extra).length > 0 ? JSON.stringify(extra) : '',
  };
}

/** A chat prompt: a non-empty array of message objects ({role, content, ...}). */
function isChat(prompt) {
  return Array.isArray(prompt) && prompt.length > 0 && prompt.every((m) => m !== null && typeof m === 'object');
}

/**
 * A ChatPrompt from messages as transformers takes them: {role, content} objects; any other
 * key (toolCalls as `tool_calls`, `tool_call_id`, `reasoning_content`...) goes to the template
 * as part of the message (extraJson). As transformers drops None-valued keys, null and
 * undefined keys are dropped: a message without text content sends `"content": null` (or its
 * list of content blocks) in extraJson, which the server reads as no content key. Options:
 * tools (JSON-able), addGenerationPrompt (default: the server's, true), continueFinalMessage,
 * templateKwargs (an object of template variables, e.g. {enable_thinking: false}).
 */
export function chatPrompt(messages, options = {}) {
  const chat = { messages: messages.map(chatMessage) };
  if (options.tools !== undefined && options.tools !== null) chat.toolsJson = JSON.stringify(options.tools);
  if (options.addGenerationPrompt !== undefined && options.addGenerationPrompt !== null) {
    chat.addGenerationPrompt = options.addGenerationPrompt;
  }
  if (options.continueFinalMessage) chat.continueFinalMessage = true;
  if (options.templateKwargs !== undefined && options.templateKwargs !== null) {
    chat.templateKwargsJson = JSON.stringify(options.templateKwargs);
  }
  return chat;
}

const STRUCTURED_KINDS = ['jsonSchema', 'jsonObject', 'regex', 'grammar', 'choice'];

/**
 * GenerateRequest.structured (a oneof) from at most one of the options jsonSchema (an object,
 * sent as JSON, or JSON text as it is), jsonObject (true), regex, grammar (GBNF text) and
 * choice (an array of strings); null when none is given. Two are a TypeError here rather than
 * the last one silently winning on the wire.
 */
function structuredOutput(options) {
  const given = STRUCTURED_KINDS.filter(
    (kind) => options[kind] !== undefined && options[kind] !== null && options[kind] !== false,
  );
  if (given.length > 1) {
    throw new TypeError(`at most one of ${STRUCTURED_KINDS.join(', ')}; got ${given.join(', ')}`);
  }
  const [kind] = given;
  const value = options[kind];
  switch (kind) {
    case undefined:
      return null;
    case 'jsonSchema':
      return { jsonSchema: typeof value === 'string' ? value : JSON.stringify(value) };
    case 'jsonObject':
      return { jsonObject: true };
    case 'choice':
      if (!Array.isArray(value)) throw new TypeError('choice: an array of strings');
      return { choice: { choices: [...value] } };
    default:
      return { [kind]: value };
  }
}

function pick(options, names) {
  const picked = {};
  for (const name of names) {
    if (options[name] !== undefined && options[name] !== null) picked[name] = options[name];
  }
  return picked;
}

/** The short name of a FinishReason ("FINISH_REASON_STOP" -> "STOP"). */
function shortReason(name) {
  return String(name).replace(/^FINISH_REASON_/, '');
}

/** A GenerateResponse as an event object; `refused` events are returned as they are. */
export function toEvent(response) {
  const { requestId, index } = response;
  switch (response.event) {
    case 'started': {
      const { promptTokens, cachedTokens, policyVersion } = response.started;
      const promptLogprobs = response.started.promptLogprobs ?? null;
      return { type: 'started', requestId, index, promptTokens, cachedTokens, policyVersion, promptLogprobs };
    }
    case 'tokens': {
      const { tokenIds, text, logprobs, topLogprobs, policyVersion } = response.tokens;
      const samplingSupport = response.tokens.samplingSupport.map((support) => support.ids);
      const routedExperts = response.tokens.routedExperts ?? [];
      return { type: 'tokens', requestId, index, tokenIds, text, logprobs, topLogprobs, samplingSupport, routedExperts, policyVersion };
    }
    case 'finished': {
      const { reason, matchedStop, usage, versionSpans, message } = response.finished;
      return {
        type: 'finished',
        requestId,
        index,
        reason: shortReason(reason),
        message,
        matchedStop,
        usage: usage ?? { promptTokens: 0, completionTokens: 0, cachedTokens: 0, proposedTokens: 0, acceptedTokens: 0 },
        versionSpans,
      };
    }
    case 'refused': {
      const { code, message, fieldViolations, retryDelayMs, startIndex } = response.refused;
      return { type: 'refused', requestId, index, code, message, fieldViolations, retryDelayMs, startIndex };
    }
    default:
      throw new Error(`unknown GenerateResponse event: ${response.event}`);
  }
}

/** Everything one sample (request id, index) streamed back, put together. */
export class Completion {
  constructor(requestId, index = 0) {
    this.requestId = requestId;
    this.index = index;
    this.started = null;
    this.tokenIds = [];
    this.text = '';
    this.logprobs = [];
    this.samplingSupport = []; // one per token, with the samplingSupport option
    this.routedExperts = []; // flattened [token, MoE layer, k], with the routedExperts option
    this.policyVersions = []; // one per token
    this.finished = null;
  }

  /** The finish reason's short name ("STOP", "LENGTH", ...), or "" while running. */
  get reason() {
    return this.finished?.reason ?? '';
  }

  add(event) {
    switch (event.type) {
      case 'started':
        this.started = event;
        break;
      case 'tokens':
        this.tokenIds.push(...event.tokenIds);
        this.text += event.text;
        this.logprobs.push(...event.logprobs);
        this.samplingSupport.push(...event.samplingSupport);
        this.routedExperts.push(...event.routedExperts);
        for (let i = 0; i < event.tokenIds.length; i++) this.policyVersions.push(event.policyVersion);
        break;
      case 'finished':
        this.finished = event;
        break;
    }
  }
}

/**
 * Reads events to their end and returns one Completion per (request id, index), in order of
 * first appearance. `started` comes once per request (index 0) and is shared by its samples.
 */
export async function collect(events) {
  const completions = new Map();
  const started = new Map();
  for await (const event of events) {
    if (event.type === 'started') started.set(event.requestId, event);
    const key = `${event.index}\u0000${event.requestId}`;
    let completion = completions.get(key);
    if (completion === undefined) completions.set(key, (completion = new Completion(event.requestId, event.index)));
    completion.add(event);
  }
  for (const completion of completions.values()) completion.started ??= started.get(completion.requestId) ?? null;
  return [...completions.values()];
}
