// Starting tests/support/serve_tiny.py (a live Sluice server on a tiny checkpoint) from Node tests.
//
// The interpreter is $SLUICE_PYTHON, else the repository's .venv; the repository's packages
// are put first on PYTHONPATH so a checkout's code is what runs.

import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { dirname, join, resolve } from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';

const TEST_DIR = dirname(fileURLToPath(import.meta.url));
export const REPO = resolve(TEST_DIR, '..', '..', '..');
export const PYTHON = process.env.SLUICE_PYTHON || join(REPO, '.venv', 'bin', 'python');
const STARTUP_MS = 120_000;

export function pythonEnv() {
  const paths = [REPO, join(REPO, 'clients', 'python')];
  if (process.env.PYTHONPATH) paths.push(process.env.PYTHONPATH);
  return { ...process.env, PYTHONPATH: paths.join(':') };
}

/**
 * Starts a server (extra `sluice serve` flags allowed) and resolves with what it printed:
 * {target, checkpointA, checkpointB, tensorsA, adminToken, apiToken}, plus `stop()`.
 */
export async function startServer(...flags) {
  const child = spawn(PYTHON, [join(REPO, 'tests', 'support', 'serve_tiny.py'), ...flags], {
    env: pythonEnv(),
    stdio: ['pipe', 'pipe', 'pipe'],
  });
  let stderr = '';
  child.stderr.on('data', (data) => {
    stderr = (stderr + data).slice(-4000);
  });
  const exited = once(child, 'exit');
  const stop = async () => {
    if (child.exitCode === null && child.signalCode === null) {
      child.stdin.end(); // serve_tiny.py stops its server and exits when stdin closes
      await exited;
    }
  };
  const lines = createInterface({ input: child.stdout });
  const ready = new Promise((resolvePromise, reject) => {
    const timer = setTimeout(() => reject(new Error(`no server within ${STARTUP_MS} ms:\n${stderr}`)), STARTUP_MS);
    lines.once('line', (line) => {
      clearTimeout(timer);
      resolvePromise(JSON.parse(line));
    });
    exited.then(([code]) => {
      clearTimeout(timer);
      reject(new Error(`serve_tiny.py exited (${code}) before serving:\n${stderr}`));
    });
  });
  try {
    return { ...(await ready), stop };
  } catch (error) {
    child.kill('SIGKILL');
    throw error;
  }
}

/** Runs a Python script of this directory with `input` as JSON on stdin; its stdout as JSON. */
export async function runPython(script, args, input) {
  const child = spawn(PYTHON, [join(TEST_DIR, script), ...args], { env: pythonEnv(), stdio: ['pipe', 'pipe', 'pipe'] });
  let stdout = '';
  let stderr = '';
  child.stdout.on('data', (data) => (stdout += data));
  child.stderr.on('data', (data) => (stderr += data));
  child.stdin.end(JSON.stringify(input));
  const [code] = await once(child, 'exit');
  if (code !== 0) throw new Error(`${script} exited ${code}:\n${stderr}`);
  return JSON.parse(stdout);
}
