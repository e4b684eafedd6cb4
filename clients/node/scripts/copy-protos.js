// `npm pack` hooks: prepack copies the repository's proto/sluice/v1/*.proto into the package
// (proto/sluice/v1), so a packed tarball carries the contract it was built from; postpack
// (`--remove`) deletes the copy again, so a checkout always reads the repository's own files.

import { copyFileSync, mkdirSync, readdirSync, rmSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const PACKAGE_ROOT = dirname(dirname(fileURLToPath(import.meta.url)));
const SOURCE = join(PACKAGE_ROOT, '..', '..', 'proto', 'sluice', 'v1');
const COPY = join(PACKAGE_ROOT, 'proto', 'sluice');

rmSync(COPY, { recursive: true, force: true });
if (!process.argv.includes('--remove')) {
  const files = readdirSync(SOURCE).filter((name) => name.endsWith('.proto'));
  if (files.length === 0) throw new Error(`no .proto files in ${SOURCE}`);
  mkdirSync(join(COPY, 'v1'), { recursive: true });
  for (const name of files) copyFileSync(join(SOURCE, name), join(COPY, 'v1', name));
}
