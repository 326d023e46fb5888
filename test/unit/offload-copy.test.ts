/**
 * The pieces sleep and wake copy by: every byte of every pair exactly once,
 * cut at the chunk size of each pair, with offsets past 4 GiB exact (a member
 * of 8 GiB sleeps), dealt round the lanes in order.
 */
import { copyPieces, dealPieces, SLEEP_COPY_CHUNK_BYTES } from '../../client/offload-copy';

const GiB = 1n << 30n;
const CHUNK = BigInt(SLEEP_COPY_CHUNK_BYTES);

function triples(pieces: BigUint64Array): Array<[bigint, bigint, bigint]> {
  const out: Array<[bigint, bigint, bigint]> = [];
  for (let i = 0; i < pieces.length; i += 3) out.push([pieces[i], pieces[i + 1], pieces[i + 2]]);
  return out;
}

describe('copy pieces', () => {
  test('an 8 GiB member and one byte more: pieces cover it exactly, across the 4 GiB line, the last one the rest', () => {
    const target = 0x7f00_0000_0000n;
    const source = 0x2000_0000_0000n;
    const length = 8n * GiB + 1n;
    const pieces = triples(copyPieces([{ target, source, length }]));
    expect(pieces.length).toBe(Number((8n * GiB) / CHUNK) + 1);
    let offset = 0n;
    for (const [to, from, bytes] of pieces) {
      expect(to).toBe(target + offset);
      expect(from).toBe(source + offset);
      offset += bytes;
    }
    expect(offset).toBe(length);
    expect(pieces[pieces.length - 1][2]).toBe(1n);
    // The piece that starts at 4 GiB: no wrap at 32 bits.
    expect(pieces[Number((4n * GiB) / CHUNK)][0]).toBe(target + 4n * GiB);
  });

  test('each pair is cut on its own; an empty pair gives none; an exact multiple has no short piece', () => {
    const pieces = triples(
      copyPieces(
        [
          { target: 100n, source: 200n, length: 10n },
          { target: 1000n, source: 2000n, length: 0n },
          { target: 5000n, source: 6000n, length: 8n },
        ],
        4n,
      ),
    );
    expect(pieces).toEqual([
      [100n, 200n, 4n],
      [104n, 204n, 4n],
      [108n, 208n, 2n],
      [5000n, 6000n, 4n],
      [5004n, 6004n, 4n],
    ]);
    expect(copyPieces([])).toHaveLength(0);
    expect(() => copyPieces([{ target: 0n, source: 0n, length: 1n }], 0n)).toThrow(RangeError);
  });

  test('dealt round the lanes: piece i on lane i % lanes, in order, no lane empty', () => {
    const pieces = copyPieces([{ target: 0n, source: 1000n, length: 5n }], 1n);
    const lanes = dealPieces(pieces, 2).map(triples);
    expect(lanes).toEqual([
      [
        [0n, 1000n, 1n],
        [2n, 1002n, 1n],
        [4n, 1004n, 1n],
      ],
      [
        [1n, 1001n, 1n],
        [3n, 1003n, 1n],
      ],
    ]);
    expect(dealPieces(copyPieces([{ target: 0n, source: 9n, length: 1n }]), 4)).toHaveLength(1);
  });
});
