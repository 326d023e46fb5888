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
