/**
 * The socket directory made, and what to tell a person whose daemon cannot
 * make or own it: the one command that sets it up for this user and group.
 */
import * as fs from 'node:fs';
import * as path from 'node:path';

/** The socket directory cannot be made: its message names the directory and the reason. */
export class SocketDirError extends Error {
  constructor(
    message: string,
    readonly code?: string,
  ) {
    super(message);
    this.name = 'SocketDirError';
  }
}

/**
 * Makes `dir` and the missing directories above it, one at a time (mode
 * `mode`). Node's recursive mkdir retries a parent it cannot make for good
 * where the kernel answers ENOENT for a name that cannot exist (/proc/x/y);
 * here each step is made once, and the first that fails says why.
 * @throws SocketDirError naming the directory, and the path that is not a directory or could not be made
 */
export function makeSocketDir(dir: string, mode: number): void {
  const missing: string[] = [];
  let at = path.resolve(dir);
  while (!fs.existsSync(at)) {
    missing.unshift(at);
    at = path.dirname(at);
  }
  if (!fs.statSync(at).isDirectory()) throw new SocketDirError(`cannot create the socket directory ${dir}: ${at} is not a directory`, 'ENOTDIR');
  for (const step of missing) {
    try {
      fs.mkdirSync(step, { mode });
    } catch (error) {
      const code = (error as NodeJS.ErrnoException).code;
      if (code === 'EEXIST' && fs.statSync(step).isDirectory()) continue;
      throw new SocketDirError(`cannot create the socket directory ${dir}: ${(error as Error).message}`, code);
    }
  }
}

/**
 * The command that gives `dir` to this process's user and the socket group,
 * for a start refused permission on it (EACCES, EPERM) — as the Docker image's
 * user meets a root-owned bind mount — or undefined for any other error.
 */
export function socketDirFix(error: unknown, dir: string, socketGroup: number | undefined): string | undefined {
  const code = (error as { code?: unknown }).code;
  const message = (error as Error).message ?? '';
  if ((code !== 'EACCES' && code !== 'EPERM') || !message.includes(dir)) return undefined;
  const group = socketGroup ?? process.getgid!();
  return `as root, give the directory to this user and the socket group: install -d -o ${process.getuid!()} -g ${group} -m ${socketGroup === undefined ? '0700' : '0750'} ${dir}`;
}
