/**
 * Runs one client process of a reliability scenario against a daemon's socket
 * directory and resolves with the one JSON line it prints; rejects, with its
 * stderr, when it exits non-zero.
 */
import { spawn } from 'node:child_process';

export function runReportingClient<T>(script: string, args: string[], socketDir: string, env: NodeJS.ProcessEnv = {}): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    const child = spawn(process.execPath, [script, ...args], {
      stdio: ['ignore', 'pipe', 'pipe'],
      env: { ...process.env, VMMD_SOCKET_DIR: socketDir, ...env },
    });
    let out = '';
    let err = '';
    child.stdout!.on('data', (chunk) => (out += chunk));
    child.stderr!.on('data', (chunk) => (err += chunk));
    child.once('exit', (code) =>
      code === 0 ? resolve(JSON.parse(out) as T) : reject(new Error(`client ${script} ${args.join(' ')} exited with ${code}: ${err}`)),
    );
  });
}
