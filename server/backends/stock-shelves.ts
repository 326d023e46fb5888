/**
 * What the stock keeps and how it is tuned: one shelf per device and size
 * holding created, exported allocations, the levels an operator configures,
 * the counters the stock reports, and the timing and headroom constants that
 * the stock (stock.ts) and its tests share.
 */
import type { BackendHandle } from './backend';

export interface StockLevel {
  /** Bytes of each allocation (a multiple of the device's granularity). */
  size: bigint;
  /** How many the shelf holds when full. */
  depth: number;
}

export interface Item {
  handle: BackendHandle;
  fd: number;
}

export interface Shelf {
  device: number;
  size: bigint;
  depth: number;
  items: Item[];
  refilling: boolean;
  /** The depth configured, never gone below; 0 for a shelf the demand added, which goes when the demand does. */
  floor: number;
}

export const newShelf = (device: number, size: bigint, depth: number, floor: number): Shelf => ({ device, size, depth, items: [], refilling: false, floor });

/** A refill stops when the device has less free than this many times the shelf's size. */
export const REFILL_HEADROOM = 4n;
/** How long a device's free bytes are trusted before the backend is asked again. */
export const FREE_BYTES_TTL_MS = 100;
/** The daemon is quiet once no Create came for this long: refills and held frees wait for it (a client allocating every 2 ms leaves 1 ms quiet after each, time enough for one free and one refill). */
export const QUIET_MS = 1;
/** A refill waits for quiet at most this long after a shelf was taken from: a steady stream still finds a stock. */
export const MAX_REFILL_DELAY_MS = 100;
/** close() waits at most this long for the driver work in flight. */
export const CLOSE_WAIT_MS = 10_000;
/** Allocations a refill creates at once (each on a driver thread; libuv has four, the frees need some). */
export const REFILL_PARALLEL = 2;
/** A shelf left with at most its depth divided by this refills at once, in one burst. */
export const REFILL_AT_FRACTION = 4;

export const shelfKey = (device: number, size: bigint) => `${device}:${size}`;

export interface StockStats {
  levels: Array<{ device: number; size: string; depth: number; held: number; demand?: true }>;
  hits: number;
  misses: number;
  created: number;
  refillFailures: number;
}
