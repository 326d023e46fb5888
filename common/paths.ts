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
