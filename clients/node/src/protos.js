// Loading the .proto files: the sluice.v1 services through @grpc/proto-loader, and the
// google.rpc error details through protobufjs (proto-loader gives no message codecs).
//
// Where the sluice.v1 protos come from: a packed package carries a copy under proto/sluice/v1
// (copied there by `npm pack`'s prepack step); a checkout of the repository, or a package
// installed from its directory (`npm install ./clients/node`, a symlink), reads the repository's
// own proto/ two levels up, so the copy can never go stale there.

import { existsSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import protobuf from 'protobufjs';

const PACKAGE_ROOT = dirname(dirname(fileURLToPath(import.meta.url)));
const OWN_PROTO = join(PACKAGE_ROOT, 'proto');
const REPO_PROTO = join(PACKAGE_ROOT, '..', '..', 'proto');
const SLUICE_FILES = ['sluice/v1/generation.proto', 'sluice/v1/admin.proto'];

/** The directory holding sluice/v1/*.proto: the packed copy first, else the repository's. */
export function sluiceProtoRoot() {
  for (const root of [OWN_PROTO, REPO_PROTO]) {
    if (SLUICE_FILES.every((file) => existsSync(join(root, file)))) return root;
  }
  throw new Error(
    `sluice client: cannot find ${SLUICE_FILES.join(', ')} under ${OWN_PROTO} or ${REPO_PROTO}; ` +
      'install the package from a packed tarball (npm pack) or from the repository checkout',
  );
}

// Field names in camelCase; 64-bit integers as JS numbers (policy versions and token counts
// stay far below 2**53); enums as their names; unset scalars as their proto3 defaults; the name
// of the set member of each oneof in a virtual field (e.g. `event: 'tokens'`).
const LOADER_OPTIONS = {
  keepCase: false,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
};

let services = null;

/** `{Generation, Admin}`: grpc-js client constructors of the sluice.v1 services. */
export function sluiceServices() {
  if (services === null) {
    const root = sluiceProtoRoot();
    const definition = protoLoader.loadSync(SLUICE_FILES, { ...LOADER_OPTIONS, includeDirs: [root] });
    const v1 = grpc.loadPackageDefinition(definition).sluice.v1;
    services = { Generation: v1.Generation, Admin: v1.Admin };
  }
  return services;
}

let rpcTypes = null;

/** protobufjs types of google.rpc.Status, BadRequest and RetryInfo (vendored protos). */
export function rpcStatusTypes() {
  if (rpcTypes === null) {
    const root = new protobuf.Root();
    root.resolvePath = (_origin, target) =>
      // google/protobuf/*.proto are built into protobufjs; google/rpc/*.proto are vendored.
      target.startsWith('google/rpc/') ? join(OWN_PROTO, target) : target;
    root.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto']);
    rpcTypes = {
      Status: root.lookupType('google.rpc.Status'),
      BadRequest: root.lookupType('google.rpc.BadRequest'),
      RetryInfo: root.lookupType('google.rpc.RetryInfo'),
    };
  }
  return rpcTypes;
}
