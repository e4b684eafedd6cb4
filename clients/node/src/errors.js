// SluiceError: a failed call's gRPC status with its google.rpc details decoded.

import { status as Status } from '@grpc/grpc-js';

import { rpcStatusTypes } from './protos.js';

const STATUS_DETAILS_KEY = 'grpc-status-details-bin';
const PUSHBACK_KEY = 'grpc-retry-pushback-ms';
const TYPE_PREFIX = 'type.googleapis.com/';
const CODE_NAMES = Object.fromEntries(Object.entries(Status).map(([name, code]) => [code, name]));

/** The status name of a gRPC code number, e.g. 8 -> "RESOURCE_EXHAUSTED". */
export function codeName(code) {
  return CODE_NAMES[code] ?? `CODE_${code}`;
}

/**
 * A call that ended with a non-OK status, or a GenerateStream start the server refused.
 *
 * `code` is the gRPC status code number (compare with grpc.status.X), `codeName` its name,
 * `message` the server's message. `details` holds every google.rpc.Status detail decoded
 * ({typeUrl, ...fields}; unknown types as {typeUrl, value: Uint8Array}); unlike the
 * `details` of a grpc-js ServiceError, which is the message string. `fieldViolations` comes
 * from google.rpc.BadRequest; `retryDelayMs` from google.rpc.RetryInfo, else from the
 * `grpc-retry-pushback-ms` trailer, else null.
 */
export class SluiceError extends Error {
  constructor({ code, message, details = [], fieldViolations = [], retryDelayMs = null, metadata = null }) {
    super(`${codeName(code)}: ${message}`);
    this.name = 'SluiceError';
    this.code = code;
    this.codeName = codeName(code);
    this.serverMessage = message;
    this.details = details;
    this.fieldViolations = fieldViolations;
    this.retryDelayMs = retryDelayMs;
    this.metadata = metadata;
  }
}

/** A grpc-js ServiceError (or a status object) as a SluiceError; anything else unchanged. */
export function toSluiceError(error) {
  if (error instanceof SluiceError || typeof error?.code !== 'number' || error.metadata === undefined) {
    return error;
  }
  const details = decodeStatusDetails(error.metadata);
  const badRequest = details.find((d) => d.typeUrl === `${TYPE_PREFIX}google.rpc.BadRequest`);
  const retryInfo = details.find((d) => d.typeUrl === `${TYPE_PREFIX}google.rpc.RetryInfo`);
  let retryDelayMs = retryInfo?.retryDelay ? durationMs(retryInfo.retryDelay) : null;
  if (retryDelayMs === null) retryDelayMs = pushbackMs(error.metadata);
  return new SluiceError({
    code: error.code,
    message: error.details ?? error.message ?? '',
    details,
    fieldViolations: (badRequest?.fieldViolations ?? []).map(({ field, description }) => ({ field, description })),
    retryDelayMs,
    metadata: error.metadata,
  });
}

/** A GenerateStream `refused` event (the status a Generate call would have ended with). */
export function refusalError(refused) {
  return new SluiceError({
    code: refused.code,
    message: refused.message,
    fieldViolations: refused.fieldViolations.map(({ field, description }) => ({ field, description })),
    retryDelayMs: refused.retryDelayMs ?? null,
  });
}

function decodeStatusDetails(metadata) {
  const [raw] = metadata?.get(STATUS_DETAILS_KEY) ?? [];
  if (!raw) return [];
  const types = rpcStatusTypes();
  const status = types.Status.decode(raw);
  const known = {
    [`${TYPE_PREFIX}google.rpc.BadRequest`]: types.BadRequest,
    [`${TYPE_PREFIX}google.rpc.RetryInfo`]: types.RetryInfo,
  };
  // google.protobuf.Any is built into protobufjs and keeps its proto field name `type_url`.
  return status.details.map(({ type_url: typeUrl, value }) => {
    const type = known[typeUrl];
    if (type === undefined) return { typeUrl, value };
    return { typeUrl, ...type.toObject(type.decode(value), { longs: Number, defaults: true }) };
  });
}

function durationMs({ seconds, nanos }) {
  return Number(seconds) * 1000 + Math.round(nanos / 1e6);
}

function pushbackMs(metadata) {
  const [value] = metadata?.get(PUSHBACK_KEY) ?? [];
  const ms = Number.parseInt(String(value ?? ''), 10);
  return Number.isFinite(ms) && ms >= 0 ? ms : null;
}
