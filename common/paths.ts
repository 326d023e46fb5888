/**
 * Where the daemon's sockets live. The daemon and the client library resolve
 * the same default, so neither needs to be told when both use it.
 */
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';

export const GRPC_SOCKET_NAME = 'vmmd.sock';
export const SESSION_SOCKET_NAME = 'vmmd.session.sock';

function writable(dir: string): boolean {
  try {
    fs.accessSync(dir, fs.constants.W_OK | fs.constants.X_OK);
    return true;
  } catch {
    return false;
  }
}

/**
 * The socket directory: VMMD_SOCKET_DIR if set; else /run/vmmd when it exists
 * or /run is writable; else $XDG_RUNTIME_DIR/vmmd; else /tmp/vmmd-$UID.
 */
export function defaultSocketDir(env: NodeJS.ProcessEnv = process.env): string {
  if (env.VMMD_SOCKET_DIR) return env.VMMD_SOCKET_DIR;
  if (fs.existsSync('/run/vmmd') ? writable('/run/vmmd') || fs.existsSync(path.join('/run/vmmd', GRPC_SOCKET_NAME)) : writable('/run')) {
    return '/run/vmmd';
  }
  if (env.XDG_RUNTIME_DIR && writable(env.XDG_RUNTIME_DIR)) return path.join(env.XDG_RUNTIME_DIR, 'vmmd');
  return path.join(os.tmpdir(), `vmmd-${process.getuid?.() ?? 'user'}`);
}

export function socketPaths(dir: string): { grpc: string; session: string } {
  return { grpc: path.join(dir, GRPC_SOCKET_NAME), session: path.join(dir, SESSION_SOCKET_NAME) };
}

/**
 * Where else a daemon may be, for a client that could not reach one in
 * `tried`: the other default places that hold a session socket, or that exist
 * but this user may not look in (a daemon started by root or another user),
 * and how to point the client there.
 */
export function whereElse(tried: string, env: NodeJS.ProcessEnv = process.env): string {
  const candidates = ['/run/vmmd', ...(env.XDG_RUNTIME_DIR ? [path.join(env.XDG_RUNTIME_DIR, 'vmmd')] : [])];
  try {
    candidates.push(
      ...fs
        .readdirSync(os.tmpdir())
        .filter((name) => /^vmmd-\d+$/.test(name))
        .map((name) => path.join(os.tmpdir(), name)),
    );
  } catch {
    // no temporary directory to list
  }
  const found: string[] = [];
  for (const dir of candidates) {
    if (path.resolve(dir) === path.resolve(tried)) continue;
    try {
      fs.statSync(path.join(dir, SESSION_SOCKET_NAME));
      found.push(`a daemon's sockets are in ${dir}`);
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code !== 'EACCES') continue;
      const stat = fs.statSync(dir);
      found.push(`${dir} exists, but uid ${process.getuid?.()} may not look in it (owner uid ${stat.uid}, group ${stat.gid}: join that group)`);
    }
  }
  return `${found.length > 0 ? `${found.join('; ')}; ` : ''}set VMMD_SOCKET_DIR (vmmctl --socket-dir) to the directory of the daemon's sockets`;
}
