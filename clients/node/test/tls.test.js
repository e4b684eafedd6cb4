// TLS and mTLS from the client's `tls` option, against an in-process grpc-js server that
// implements GetServerInfo (the Python server's TLS is tested on the Python side). Certificates
// are made for the test with openssl.

import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import { promisify } from 'node:util';

import * as grpc from '@grpc/grpc-js';

import { Client, SluiceError, status } from '../index.js';
import { sluiceServices } from '../src/protos.js';

const run = promisify(execFile);
let dir;
let files; // the CA certificate and the server's and client's key pairs
let server;
let port;
const seenAuthorization = [];

/** A self-signed CA and a certificate it signs for `name` (127.0.0.1 as its address). */
async function makeCertificate(name, caKey, caCert) {
  const key = join(dir, `${name}.key`);
  const csr = join(dir, `${name}.csr`);
  const cert = join(dir, `${name}.crt`);
  const ext = join(dir, `${name}.ext`);
  await run('openssl', ['req', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes', '-keyout', key, '-out', csr, '-subj', `/CN=${name}`]);
  await run('sh', ['-c', `printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > '${ext}'`]);
  await run('openssl', ['x509', '-req', '-in', csr, '-CA', caCert, '-CAkey', caKey, '-CAcreateserial', '-days', '1', '-extfile', ext, '-out', cert]);
  return { key, cert };
}

before(async () => {
  dir = await mkdtemp(join(tmpdir(), 'sluice-node-tls-'));
  const caKey = join(dir, 'ca.key');
  const caCert = join(dir, 'ca.crt');
  await run('openssl', ['req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes', '-keyout', caKey, '-out', caCert, '-days', '1', '-subj', '/CN=test-ca']);
  const serverPair = await makeCertificate('server', caKey, caCert);
  const clientPair = await makeCertificate('client', caKey, caCert);
  files = { caCert, serverPair, clientPair };

  server = new grpc.Server();
  server.addService(sluiceServices().Generation.service, {
    GetServerInfo: (call, callback) => {
      seenAuthorization.push(call.metadata.get('authorization')[0]);
      callback(null, { model: 'tls-fake', state: 'SERVING_STATE_SERVING', policyVersion: 7 });
    },
  });
  const credentials = grpc.ServerCredentials.createSsl(
    await readFile(caCert),
    [{ private_key: await readFile(serverPair.key), cert_chain: await readFile(serverPair.cert) }],
    true, // mTLS: a client must present a certificate signed by the CA
  );
  port = await new Promise((resolve, reject) =>
    server.bindAsync('127.0.0.1:0', credentials, (error, bound) => (error ? reject(error) : resolve(bound))),
  );
});

after(async () => {
  server?.forceShutdown();
  if (dir) await rm(dir, { recursive: true, force: true });
});

test('mTLS with the CA, certificate and key as file paths; the API token reaches the server', async () => {
  const { caCert, clientPair } = files;
  const client = new Client(`127.0.0.1:${port}`, {
    apiToken: 'secret',
    tls: { ca: caCert, cert: clientPair.cert, key: clientPair.key },
    deadlineMs: 5000,
  });
  try {
    const info = await client.info();
    assert.deepEqual([info.model, info.state, info.policyVersion], ['tls-fake', 'SERVING', 7]);
    assert.equal(seenAuthorization.at(-1), 'Bearer secret');
  } finally {
    client.close();
  }
});

test('TLS without a client certificate is refused by an mTLS server; plaintext is too', async () => {
  const { caCert } = files;
  for (const tls of [{ ca: await readFile(caCert) }, undefined]) {
    const client = new Client(`127.0.0.1:${port}`, { tls, retry: false, deadlineMs: 3000 });
    try {
      await assert.rejects(client.info(), (error) => error instanceof SluiceError && error.code === status.UNAVAILABLE);
    } finally {
      client.close();
    }
  }
});
