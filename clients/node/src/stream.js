// GenerateStream: many requests over one bidirectional call, their events routed per request.

import { randomUUID } from 'node:crypto';

import { SluiceError, refusalError, toSluiceError } from './errors.js';
import { EventQueue } from './queue.js';
import { buildRequest, collect, toEvent } from './requests.js';

/**
 * One GenerateStream call. `start()` sends a request and returns its handle, whose events
 * are read with `for await`; `cancel(id)` cancels one request; `end()` half-closes (send it
 * once every request is started: the server then ends the call after the last one finishes).
 *
 * Every started request ends exactly once for its reader: after its `finished` event(s) (one
 * per sample), or by throwing a SluiceError when the server refused the start or the whole
 * call failed. `closed` settles when the call ends (rejecting with the call's SluiceError).
 */
export class GenerateStream {
  #call;
  #byId = new Map(); // request id -> StreamRequest, while it runs
  #byStartIndex = new Map(); // start index -> StreamRequest, until it ends (refusals name it)
  #starts = 0;
  #ended = false;
  #halfClosed = false;

  constructor(call) {
    this.#call = call;
    this.closed = new Promise((resolve, reject) => {
      call.on('data', (response) => this.#route(toEvent(response)));
      call.on('error', (error) => {
        const failure = toSluiceError(error);
        this.#end(failure);
        reject(failure);
      });
      call.on('status', (status) => {
        if (status.code !== 0) return; // 'error' reports it
        this.#end(null);
        resolve();
      });
    });
    this.closed.catch(() => {}); // a failed call is reported to each request's reader too
  }

  /** Sends a request; its id is made up here when options.requestId is not given. */
  start(prompt, options = {}) {
    this.#checkWritable('start');
    const requestId = options.requestId || randomUUID();
    const message = buildRequest(prompt, { ...options, requestId });
    const request = new StreamRequest(this, requestId, this.#starts++, message.n ?? 1);
    this.#byStartIndex.set(request.startIndex, request);
    if (!this.#byId.has(requestId)) this.#byId.set(requestId, request);
    this.#call.write({ start: message });
    return request;
  }

  /** Cancels a request of this stream by id (its reader then sees reason CANCELLED). */
  cancel(requestId) {
    this.#checkWritable('cancel');
    this.#call.write({ cancelRequestId: requestId });
  }

  /** Half-closes: no more starts or cancels; the call ends when every request has. */
  end() {
    if (this.#halfClosed || this.#ended) return;
    this.#halfClosed = true;
    this.#call.end();
  }

  /** Ends the call at once; running requests end by throwing CANCELLED. */
  abort() {
    this.#call.cancel();
  }

  #checkWritable(what) {
    if (this.#ended || this.#halfClosed) throw new Error(`GenerateStream.${what}: the stream is closed for sending`);
  }

  #route(event) {
    if (event.type === 'refused') {
      const request = this.#byStartIndex.get(event.startIndex);
      if (request === undefined) return this.#unrouted(event);
      this.#forget(request);
      request.queue.fail(refusalError(event));
      return;
    }
    const request = this.#byId.get(event.requestId);
    if (request === undefined) return this.#unrouted(event);
    request.queue.push(event);
    if (event.type === 'finished' && ++request.finishedSamples === request.samples) {
      this.#forget(request);
      request.queue.close();
    }
  }

  #unrouted(event) {
    // Every start carries an id made here, so the server never sends one we do not know.
    this.#end(new Error(`GenerateStream: an event for no request of this stream: ${JSON.stringify(event)}`));
    this.#call.cancel();
  }

  #forget(request) {
    this.#byStartIndex.delete(request.startIndex);
    if (this.#byId.get(request.requestId) === request) this.#byId.delete(request.requestId);
  }

  #end(error) {
    if (this.#ended) return;
    this.#ended = true;
    for (const request of new Set([...this.#byId.values(), ...this.#byStartIndex.values()])) {
      request.queue.fail(
        error ?? new SluiceError({ code: 13, message: `the stream ended before request ${request.requestId} finished` }),
      );
    }
    this.#byId.clear();
    this.#byStartIndex.clear();
  }

  /** Called when a request's reader stops early: cancel it on the server. */
  _readerLeft(request) {
    this.#forget(request);
    if (!this.#ended && !this.#halfClosed) this.#call.write({ cancelRequestId: request.requestId });
  }
}

/** One request of a GenerateStream: `for await (const event of request)`. */
export class StreamRequest {
  constructor(stream, requestId, startIndex, samples) {
    this.stream = stream;
    this.requestId = requestId;
    this.startIndex = startIndex; // which start of the stream this is, counting from 0
    this.samples = samples;
    this.finishedSamples = 0;
    this.queue = new EventQueue(() => stream._readerLeft(this));
  }

  [Symbol.asyncIterator]() {
    return this.queue[Symbol.asyncIterator]();
  }

  cancel() {
    this.stream.cancel(this.requestId);
  }

  /** Reads the events to the end: the Completion of sample 0 (all samples: `collect(request)`). */
  async complete() {
    const [first] = await collect(this);
    return first;
  }
}
