// @sluice/client: a Node.js client for Sluice's gRPC Generation and Admin services.
export { AFFINITY_KEY, Client, DEFAULT_SERVICE_CONFIG } from './src/client.js';
export { SluiceError, codeName } from './src/errors.js';
export { Completion, buildRequest, chatPrompt, collect } from './src/requests.js';
export { GenerateStream, StreamRequest } from './src/stream.js';
export { readSafetensorsIndex } from './src/safetensors.js';
export { status } from '@grpc/grpc-js';
