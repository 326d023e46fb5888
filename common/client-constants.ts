/**
 * The constants both client libraries (TypeScript and Python) share with the
 * daemon, declared once: the TypeScript client imports them, and
 * python/src/vmmd/_declared.py is generated from CLIENT_CONSTANTS
 * (scripts/gen-declared.js).
 */
import { DEFAULT_BUSY_POLL_MICROS } from './busy-poll';
import { DEFAULT_TRANSFER_WAIT_MS } from './daemon-settings';
import { ERROR_CODE_KEY, MAX_MESSAGE_BYTES, PROTOCOL_VERSION, SESSION_METADATA_KEY } from './protocol';

/** Reads and writes from this size up take the staging buffer; smaller ones stream over gRPC. */
export const STAGED_MIN_BYTES = 256 * 1024;
/** The default staging buffer: two halves of 16 MiB (mapped on first use only). */
export const DEFAULT_STAGING_BYTES = 32 << 20;
/** The largest staging buffer the daemon maps. */
export const MAX_STAGING_BYTES = 1 << 30;

/** The most allocations one AllocateAll asks for (below the daemon's default of unread descriptors per session). */
export const MAX_ALLOCATE_ALL_SIZES = 256;
/** The longest an AllocateAll may wait for its memory, in milliseconds. */
export const MAX_ALLOCATE_ALL_WAIT_MS = 600_000;

/** Each shared constant with its Python name and what it is, in the generated module's order. */
export const CLIENT_CONSTANTS = {
  PROTOCOL_VERSION: { value: PROTOCOL_VERSION, meaning: 'the session protocol this tree speaks (proto/vmmd/v1/session.proto)' },
  MAX_MESSAGE_BYTES: { value: MAX_MESSAGE_BYTES, meaning: 'the longest session-socket frame either side reads' },
  SESSION_METADATA_KEY: { value: SESSION_METADATA_KEY, meaning: 'the gRPC metadata key that carries the session token' },
  ERROR_CODE_KEY: { value: ERROR_CODE_KEY, meaning: "the gRPC trailer that carries a refusal's string code" },
  STAGED_MIN_BYTES: { value: STAGED_MIN_BYTES, meaning: 'reads and writes from this size up take the staging buffer; smaller ones stream over gRPC' },
  DEFAULT_STAGING_BYTES: { value: DEFAULT_STAGING_BYTES, meaning: 'the default staging buffer: two halves of 16 MiB (made on first use only)' },
  MAX_STAGING_BYTES: { value: MAX_STAGING_BYTES, meaning: 'the largest staging buffer the daemon maps' },
  DEFAULT_BUSY_POLL_US: { value: DEFAULT_BUSY_POLL_MICROS, meaning: 'how long a caller spins for its answer before it sleeps, in microseconds' },
  DEFAULT_TRANSFER_WAIT_MS: { value: DEFAULT_TRANSFER_WAIT_MS, meaning: 'how long a descriptor sent as a transfer is waited for' },
  MAX_ALLOCATE_ALL_SIZES: { value: MAX_ALLOCATE_ALL_SIZES, meaning: 'the most allocations one AllocateAll (a wake) asks for' },
  MAX_ALLOCATE_ALL_WAIT_MS: { value: MAX_ALLOCATE_ALL_WAIT_MS, meaning: 'the longest an AllocateAll may wait for its memory, in milliseconds' },
} as const;
