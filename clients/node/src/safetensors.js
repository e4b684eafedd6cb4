// Reading a .safetensors file's tensors as UpdateWeights TensorChunks, a chunk at a time.
//
// The format: an 8-byte little-endian header length N, N bytes of JSON mapping each tensor
// name to {dtype, shape, data_offsets: [begin, end]} (offsets counted from the end of the
// header; an optional "__metadata__" entry holds strings), then the raw row-major data.

import { open } from 'node:fs/promises';

// Larger headers are not safetensors files (the reference implementation's limit).
const MAX_HEADER_BYTES = 100_000_000;

/** `[{name, dtype, shape, begin, end}]` (absolute byte offsets in the file) of a .safetensors file. */
export async function readSafetensorsIndex(path) {
  const file = await open(path, 'r');
  try {
    return await readIndex(file, path);
  } finally {
    await file.close();
  }
}

async function readIndex(file, path) {
  const { size } = await file.stat();
  const prefix = Buffer.alloc(8);
  if (size < 8 || (await file.read(prefix, 0, 8, 0)).bytesRead !== 8) {
    throw new Error(`${path}: not a safetensors file (shorter than 8 bytes)`);
  }
  const headerBytes = prefix.readBigUInt64LE(0);
  if (headerBytes > BigInt(Math.min(MAX_HEADER_BYTES, size - 8))) {
    throw new Error(`${path}: not a safetensors file (header length ${headerBytes} for ${size} bytes)`);
  }
  const raw = Buffer.alloc(Number(headerBytes));
  await file.read(raw, 0, raw.length, 8);
  let header;
  try {
    header = JSON.parse(raw.toString('utf8'));
  } catch (error) {
    throw new Error(`${path}: not a safetensors file (header is not JSON: ${error.message})`);
  }
  const base = 8 + raw.length;
  const tensors = [];
  for (const [name, entry] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    const [begin, end] = entry.data_offsets ?? [];
    if (!(Number.isInteger(begin) && Number.isInteger(end) && 0 <= begin && begin <= end && base + end <= size)) {
      throw new Error(`${path}: tensor ${name}: data_offsets ${JSON.stringify(entry.data_offsets)} outside the file`);
    }
    tensors.push({ name, dtype: entry.dtype, shape: entry.shape, begin: base + begin, end: base + end });
  }
  return tensors;
}

/**
 * Every tensor of the file as TensorChunk messages of at most `chunkBytes` bytes, in file
 * order; dtype and shape ride on each tensor's first chunk only (an empty tensor has no
 * chunk). One chunk is read per step of the iteration, so memory stays bounded by what the
 * caller holds on to.
 */
export async function* safetensorsChunks(path, chunkBytes) {
  const file = await open(path, 'r');
  try {
    for (const { name, dtype, shape, begin, end } of await readIndex(file, path)) {
      for (let offset = 0; offset < end - begin; offset += chunkBytes) {
        const data = Buffer.alloc(Math.min(chunkBytes, end - begin - offset));
        await file.read(data, 0, data.length, begin + offset);
        yield chunk(name, dtype, shape, offset, data);
      }
    }
  } finally {
    await file.close();
  }
}

/** `{name: {dtype, shape, data}}` held in memory, as TensorChunk messages like the above. */
export function* memoryChunks(tensors, chunkBytes) {
  for (const [name, { dtype, shape, data }] of Object.entries(tensors)) {
    const bytes = Buffer.from(data.buffer, data.byteOffset, data.byteLength);
    for (let offset = 0; offset < bytes.length; offset += chunkBytes) {
      yield chunk(name, dtype, shape, offset, bytes.subarray(offset, offset + chunkBytes));
    }
  }
}

function chunk(name, dtype, shape, offset, data) {
  const tensor = { name, offset, data };
  if (offset === 0) Object.assign(tensor, { dtype, shape });
  return { tensor };
}
