/**
 * The bytes of a store in the crash-cycle scenario, shared by its workers
 * (which write them) and the test (which checks every listed store whole):
 * each piece of a store is its name and the piece's offset, repeated.
 */
import { createHash } from 'node:crypto';

/** The piece a store is written in; a store's size is a multiple of it. */
export const STORE_PIECE_BYTES = 1n << 20n;

/** The bytes of store `name` from `offset` (a multiple of STORE_PIECE_BYTES), one piece long. */
export function storePattern(name: string, offset: bigint): Buffer {
  return Buffer.alloc(Number(STORE_PIECE_BYTES), `${name}@${offset};`);
}

/** The sha256 of a whole store of `size` bytes named `name`. */
export function storeChecksum(name: string, size: bigint): string {
  const hash = createHash('sha256');
  for (let offset = 0n; offset < size; offset += STORE_PIECE_BYTES) hash.update(storePattern(name, offset));
  return hash.digest('hex');
}
