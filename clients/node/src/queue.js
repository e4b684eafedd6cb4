// EventQueue: pushed values read with `for await`; the bridge from grpc-js callbacks to the
// async iterators this package returns.

/**
 * Values pushed by a producer, read once by one consumer. `close()` ends iteration after the
 * values already pushed; `fail(error)` ends it by throwing `error` after them. `onReturn` runs
 * when the consumer stops early (break, return, throw in the loop body), e.g. to cancel a call.
 */
export class EventQueue {
  #values = [];
  #waiting = null; // the pending next() of a consumer that found the queue empty
  #ended = false;
  #error = null;
  #onReturn;

  constructor(onReturn = () => {}) {
    this.#onReturn = onReturn;
  }

  get ended() {
    return this.#ended;
  }

  push(value) {
    if (this.#ended) return;
    if (this.#waiting !== null) {
      const { resolve } = this.#waiting;
      this.#waiting = null;
      resolve({ value, done: false });
    } else {
      this.#values.push(value);
    }
  }

  close() {
    this.#end(null);
  }

  fail(error) {
    this.#end(error);
  }

  #end(error) {
    if (this.#ended) return;
    this.#ended = true;
    this.#error = error;
    if (this.#waiting !== null) {
      const { resolve, reject } = this.#waiting;
      this.#waiting = null;
      if (error === null) resolve({ value: undefined, done: true });
      else reject(error);
    }
  }

  [Symbol.asyncIterator]() {
    return {
      next: () => {
        if (this.#values.length > 0) return Promise.resolve({ value: this.#values.shift(), done: false });
        if (this.#ended) {
          const error = this.#error;
          this.#error = null; // thrown once; later next() calls just report done
          return error === null ? Promise.resolve({ value: undefined, done: true }) : Promise.reject(error);
        }
        return new Promise((resolve, reject) => {
          this.#waiting = { resolve, reject };
        });
      },
      return: () => {
        if (!this.#ended) {
          this.#end(null);
          this.#onReturn();
        }
        this.#values = [];
        return Promise.resolve({ value: undefined, done: true });
      },
    };
  }
}
