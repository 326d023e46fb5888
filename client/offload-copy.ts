/**
 * The bulk copies of sleep and wake, by address: between memory this process
 * mapped (device memory and the daemon's host memory mapped for the device
 * on cuda, memfd pages on the host backend), cut into pieces that go round a
 * few lanes (cuda: streams of one driver thread, the copy engines working on
 * several pieces at once; host backend: worker threads). No Node Buffer holds
 * the bytes, so a member of any size copies (a Buffer stops at 4 GiB), and a
 * copy resolves only once every byte has landed.
 */
import { native } from '../native/client';

/** Bytes of one piece of a copy: large enough for the copy engine's full speed, small enough that lanes overlap. */
export const SLEEP_COPY_CHUNK_BYTES = 64 << 20;
/** Lanes the pieces go round (cuda: streams; host backend: worker threads): one piece's copy overlaps the next's. */
export const SLEEP_COPIES_IN_FLIGHT = 2;

/** One copy: `length` bytes from `source` to `target`, both addresses of this process's mappings. */
export interface CopyPair {
  readonly target: bigint;
  readonly source: bigint;
  readonly length: bigint;
}

/**
 * The pieces of `pairs`, as (target, source, length) triples: each pair cut at
 * every `chunk` bytes of its own, the last piece of a pair holding the rest; an
 * empty pair gives none. Pieces of one pair are consecutive, in address order.
 */
export function copyPieces(pairs: readonly CopyPair[], chunk: bigint = BigInt(SLEEP_COPY_CHUNK_BYTES)): BigUint64Array {
  if (chunk <= 0n) throw new RangeError(`a copy piece of ${chunk} bytes: it is at least 1`);
  const count = pairs.reduce((sum, pair) => sum + Number((pair.length + chunk - 1n) / chunk), 0);
  const pieces = new BigUint64Array(count * 3);
  let at = 0;
  for (const pair of pairs) {
    for (let offset = 0n; offset < pair.length; offset += chunk) {
      const rest = pair.length - offset;
      pieces[at++] = pair.target + offset;
      pieces[at++] = pair.source + offset;
      pieces[at++] = rest < chunk ? rest : chunk;
    }
  }
  return pieces;
}

/** Deals the triples of `pieces` round `lanes` lanes: piece i goes to lane i % lanes. */
export function dealPieces(pieces: BigUint64Array, lanes: number): BigUint64Array[] {
  const count = pieces.length / 3;
  const dealt = Array.from({ length: Math.min(lanes, count) }, (_, lane) => new BigUint64Array(Math.ceil((count - lane) / lanes) * 3));
  for (let piece = 0; piece < count; piece++) dealt[piece % lanes].set(pieces.subarray(piece * 3, piece * 3 + 3), Math.floor(piece / lanes) * 3);
  return dealt;
}

/**
 * Copies every pair and resolves once every byte is in place: on cuda (`device`
 * a device index) by the copy engines on SLEEP_COPIES_IN_FLIGHT streams of a
 * driver thread; on the host backend (`device` undefined) by memmove on as
 * many worker threads. A failure rejects only after every lane has stopped.
 */
export async function copyBetween(device: number | undefined, pairs: readonly CopyPair[]): Promise<void> {
  const pieces = copyPieces(pairs);
  if (pieces.length === 0) return;
  if (device !== undefined) {
    await native.cudaCopyPieces(device, pieces, SLEEP_COPIES_IN_FLIGHT);
    return;
  }
  const settled = await Promise.allSettled(dealPieces(pieces, SLEEP_COPIES_IN_FLIGHT).map((lane) => native.hostCopyPieces(lane)));
  const failed = settled.find((outcome) => outcome.status === 'rejected');
  if (failed !== undefined) throw (failed as PromiseRejectedResult).reason;
}
