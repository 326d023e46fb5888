/**
 * The parked state's journal: lines appended to a memfd that is itself
 * parked, so that it outlives the serving process as the memory does. One
 * write(2) per line at the end of the file: a process killed at any moment
 * leaves every line before it whole and at most the last one cut short.
 */
import * as fs from 'node:fs';
import { addon } from '../../native';
import { JournalLine, ParkedState, replay, snapshotLines } from './parked-records';

const NEWLINE = 0x0a;

/** The whole file behind `fd`, read from its start. */
function readAll(fd: number): Buffer {
  const size = fs.fstatSync(fd).size;
  const buffer = Buffer.alloc(size);
  let done = 0;
  while (done < size) {
    const n = fs.readSync(fd, buffer, done, size - done, done);
    if (n === 0) break;
    done += n;
  }
  return buffer.subarray(0, done);
}

export class Journal {
  // Invariant: `length` is the memfd's size: every line written ends there.
  private constructor(
    readonly fd: number,
    private length: number,
    /** Lines written since the journal was made (its snapshot's included). */
    public lines: number,
  ) {}

  /** A new journal holding `state`'s snapshot. */
  static create(state: ParkedState): Journal {
    const fd = addon.stateMemfdCreate('vmmd:parked-state');
    const journal = new Journal(fd, 0, 0);
    try {
      const text = [...snapshotLines(state)].map((line) => `${JSON.stringify(line)}\n`).join('');
      journal.write(text);
      journal.lines = text === '' ? 0 : text.split('\n').length - 1;
    } catch (error) {
      addon.close(fd);
      throw error;
    }
    return journal;
  }

  /** Reads a parked journal (the descriptor stays the caller's). */
  static read(fd: number): ParkedState {
    return replay(readAll(fd).toString('utf8'));
  }

  /**
   * Goes on with a parked journal: reads the state it describes, and appends
   * after it from then on (the descriptor becomes the journal's). A restart
   * then writes nothing before it serves, where a fresh journal would write
   * every object's line again. A last line a crash cut short stays a line of
   * its own, skipped by every replay.
   */
  static resume(fd: number): { journal: Journal; state: ParkedState } {
    const bytes = readAll(fd);
    const text = bytes.toString('utf8');
    const state = replay(text);
    let lines = 0;
    for (let at = bytes.indexOf(NEWLINE); at >= 0; at = bytes.indexOf(NEWLINE, at + 1)) lines++;
    const journal = new Journal(fd, bytes.length, lines);
    if (bytes.length > 0 && bytes[bytes.length - 1] !== NEWLINE) journal.write('\n');
    return { journal, state };
  }

  /**
   * @param text the line already serialized, when the caller has it
   * @throws the write's error (nothing is recorded then)
   */
  append(line: JournalLine, text = JSON.stringify(line)): void {
    this.write(`${text}\n`);
    this.lines++;
  }

  close(): void {
    addon.close(this.fd);
  }

  private write(text: string): void {
    const data = Buffer.from(text);
    let done = 0;
    while (done < data.length) done += fs.writeSync(this.fd, data, done, data.length - done, this.length + done);
    this.length += data.length;
  }
}
