/**
 * vmmctl's files: the bytes a load reads (a file, or a pipe read whole), a
 * dump's output written under a temporary name and renamed once whole, and
 * the progress both show on standard error.
 */
import { status as Status } from '@grpc/grpc-js';
import * as fs from 'node:fs';
import { performance } from 'node:perf_hooks';
import { VmmdError } from '../errors';

/** The size of one read or write of a load or dump. */
export const CHUNK = 8 << 20;
const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

/** 1536 → "1.5 KiB"; below 1 KiB in bytes. */
export function humanBytes(bytes: number | bigint | string): string {
  let value = Number(bytes);
  let unit = 0;
  while (value >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit++;
  }
  return unit === 0 ? `${value} B` : `${value.toFixed(1)} ${UNITS[unit]}`;
}

/** A progress bar on stderr: redrawn in place on a terminal, every 10% otherwise. */
export class Progress {
  private lastTenth = -1;

  /** @param started when the work began (performance.now()): a pipe's read counts in the time */
  constructor(
    private readonly label: string,
    private readonly total: number,
    private readonly started = performance.now(),
  ) {}

  update(done: number): void {
    const fraction = this.total === 0 ? 1 : done / this.total;
    if (process.stderr.isTTY) {
      const width = 30;
      const filled = Math.round(fraction * width);
      process.stderr.write(
        `\r${this.label} [${'#'.repeat(filled)}${' '.repeat(width - filled)}] ${(fraction * 100).toFixed(0).padStart(3)}% ${humanBytes(done)}/${humanBytes(this.total)}`,
      );
    } else if (Math.floor(fraction * 10) > this.lastTenth) {
      this.lastTenth = Math.floor(fraction * 10);
      process.stderr.write(`${this.label}: ${(fraction * 100).toFixed(0)}% (${humanBytes(done)} of ${humanBytes(this.total)})\n`);
    }
  }

  /** Seconds since the start, and the line that says what was done. */
  finish(verb: string): { seconds: number; line: string } {
    const seconds = (performance.now() - this.started) / 1000;
    if (process.stderr.isTTY) process.stderr.write('\n');
    const rate = this.total / Math.max(seconds, 1e-9);
    return { seconds, line: `${verb} ${humanBytes(this.total)} in ${seconds.toFixed(2)} s (${humanBytes(Math.round(rate))}/s)` };
  }
}

/**
 * The bytes to load: a regular file is read in chunks as it uploads; standard
 * input ("-", /dev/stdin) or a pipe has no size up front and is read whole first.
 */
export function openSource(file: string): { size: number; chunks: (buffer: Buffer) => Iterable<Buffer>; close: () => void; regular?: { fd: number } } {
  const fd = file === '-' ? 0 : fs.openSync(file, 'r');
  const close = () => {
    if (fd !== 0) fs.closeSync(fd);
  };
  const stat = fs.fstatSync(fd);
  if (stat.isDirectory()) {
    close();
    throw notADirectory(file);
  }
  if (stat.isFile()) {
    const size = stat.size;
    return {
      size,
      regular: { fd },
      chunks: function* (buffer) {
        for (let done = 0; done < size;) {
          const read = fs.readSync(fd, buffer, 0, Math.min(buffer.length, size - done), done);
          if (read === 0) throw new VmmdError('FILE_CHANGED', Status.ABORTED, `${file} shrank while it was read`);
          yield buffer.subarray(0, read);
          done += read;
        }
      },
      close,
    };
  }
  const parts: Buffer[] = [];
  for (;;) {
    const part = Buffer.allocUnsafe(CHUNK);
    let read: number;
    try {
      read = fs.readSync(fd, part, 0, CHUNK, null);
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code === 'EAGAIN') continue;
      if ((error as NodeJS.ErrnoException).code === 'EOF') break;
      throw error;
    }
    if (read === 0) break;
    parts.push(part.subarray(0, read));
  }
  const whole = Buffer.concat(parts);
  return { size: whole.length, chunks: () => [whole], close };
}

/** "FILE is a directory": Node's EISDIR does not name the path. */
function notADirectory(file: string): VmmdError {
  return new VmmdError('EISDIR', Status.INVALID_ARGUMENT, `${file} is a directory: name a file`);
}

/**
 * A file written under a temporary name beside it (FILE.partial-PID) and
 * renamed to FILE once whole: an interrupted or failed dump leaves no file
 * that looks complete. Ctrl-C removes the partial file and exits 130.
 */
export class PartialFile {
  readonly fd: number;
  private readonly path: string;
  private done = false;
  private readonly onInterrupt = () => {
    this.abandon();
    process.stderr.write(`\nvmmctl: interrupted; ${this.file} not written\n`);
    process.exit(130);
  };

  /** @throws VmmdError EISDIR; the open's own error */
  constructor(private readonly file: string) {
    if (fs.statSync(file, { throwIfNoEntry: false })?.isDirectory()) throw notADirectory(file);
    this.path = `${file}.partial-${process.pid}`;
    this.fd = fs.openSync(this.path, 'w');
    process.once('SIGINT', this.onInterrupt);
  }

  /** Whole: closed and renamed to its name. */
  finish(): void {
    fs.closeSync(this.fd);
    fs.renameSync(this.path, this.file);
    this.done = true;
    process.off('SIGINT', this.onInterrupt);
  }

  /** Unless finished: closed and removed. */
  abandon(): void {
    if (this.done) return;
    this.done = true;
    process.off('SIGINT', this.onInterrupt);
    try {
      fs.closeSync(this.fd);
    } catch {
      // closed already
    }
    fs.rmSync(this.path, { force: true });
  }
}
