/**
 * What /proc says about a session's peer process: its command name and
 * cgroup (the container or pod, for an operator tying memory to workloads, as
 * DCGM's exporter does), and whether it still runs. Linux only; empty strings
 * where /proc cannot be read (another pid namespace, a process gone).
 */
import * as fs from 'node:fs';

export interface PeerProcess {
  /** /proc/PID/comm: the executable's name, at most 15 characters. */
  command: string;
  /** The cgroup v2 path (the "0::" line of /proc/PID/cgroup), else the first v1 line's path. */
  cgroup: string;
  /** Field 22 of /proc/PID/stat: tells a reused pid from the same process. */
  startTime: string;
}

function read(file: string): string {
  try {
    return fs.readFileSync(file, 'utf8');
  } catch {
    return '';
  }
}

/** Fields after the command in /proc/PID/stat (the command may hold spaces and parentheses). */
function statFields(pid: number): string[] {
  const stat = read(`/proc/${pid}/stat`);
  return stat.slice(stat.lastIndexOf(')') + 2).split(' ');
}

export function describeProcess(pid: number): PeerProcess {
  const lines = read(`/proc/${pid}/cgroup`).split('\n').filter(Boolean);
  const unified = lines.find((line) => line.startsWith('0::'));
  const cgroup = (unified ?? lines[0] ?? '').split(':').slice(2).join(':');
  return { command: read(`/proc/${pid}/comm`).trim(), cgroup, startTime: statFields(pid)[19] ?? '' };
}

/** PF_EXITING in /proc/PID/stat's flags: set as a process starts to exit, before its files close. */
const PF_EXITING = 0x4;

/**
 * True while the process that opened the session runs and is not exiting
 * (not a zombie, not a new process with its pid). A killed process has
 * PF_EXITING set before the kernel closes its socket, so a hang-up caused by
 * its death never reads as a clean close.
 */
export function stillRunning(pid: number, startTime: string): boolean {
  if (pid <= 0 || startTime === '') return false;
  const fields = statFields(pid);
  if (fields.length <= 19 || fields[19] !== startTime || fields[0] === 'Z' || fields[0] === 'X') return false;
  return (Number(fields[6]) & PF_EXITING) === 0;
}

/** Signals that mean a process crashed or was killed outright, not that it exited. */
const CRASH_SIGNALS = new Map([
  [4, 'SIGILL'],
  [6, 'SIGABRT'],
  [7, 'SIGBUS'],
  [8, 'SIGFPE'],
  [9, 'SIGKILL'],
  [11, 'SIGSEGV'],
]);

/**
 * The signal a process is ending by, read as its session socket hangs up:
 * the kernel sets the exit code (field 52 of /proc/PID/stat) before it closes
 * the process's files. Undefined for a process still running, one that
 * exited, one gone before the read, or one the daemon may not inspect (the
 * field reads 0 then): a crash is told apart only where the daemon can see it.
 */
export function exitSignal(pid: number, startTime: string): number | undefined {
  if (pid <= 0 || startTime === '') return undefined;
  const fields = statFields(pid);
  if (fields.length <= 49 || fields[19] !== startTime || (Number(fields[6]) & PF_EXITING) === 0) return undefined;
  const signal = Number(fields[49]) & 0x7f;
  return signal === 0 ? undefined : signal;
}

/** How a session ended, as its log line says it: the level is an operator's cue (a crash is a warning, the rest are not). */
export function sessionEnding(byDaemon: boolean, running: boolean, signal: number | undefined): { end: string; level: 'info' | 'warn'; message: string } {
  if (byDaemon) return { end: 'closed-by-daemon', level: 'info', message: 'session closed by the daemon (stopping)' };
  if (running) return { end: 'closed', level: 'info', message: 'session closed by the client' };
  const crash = signal === undefined ? undefined : CRASH_SIGNALS.get(signal);
  if (crash !== undefined) return { end: 'crashed', level: 'warn', message: `session lost: the client process ended by ${crash} without closing it` };
  return { end: 'process-gone', level: 'info', message: 'session ended without closing: the client process ended without close()' };
}
