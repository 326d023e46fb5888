/**
 * Every string error code vmmd answers with, each with its one gRPC status and
 * what it means. The daemon's error helpers accept only the codes declared
 * here with their own status, so a misspelt code or a code used with a second
 * status does not compile; the Python client's constants and docs/PROTOCOL.md's
 * code table are generated from this table (scripts/gen-declared.js).
 *
 * `by` says who produces a code: the daemon's own refusals ('daemon'), a
 * backend's or the addon's error code mapped to its status as it crosses the
 * wire ('backend'), a session-socket error frame that answers no RPC
 * ('session'), or the client libraries themselves ('client').
 */

/** The gRPC status names vmmd answers with. */
export type StatusName =
  | 'INVALID_ARGUMENT'
  | 'NOT_FOUND'
  | 'ALREADY_EXISTS'
  | 'PERMISSION_DENIED'
  | 'RESOURCE_EXHAUSTED'
  | 'FAILED_PRECONDITION'
  | 'ABORTED'
  | 'OUT_OF_RANGE'
  | 'UNIMPLEMENTED'
  | 'INTERNAL'
  | 'UNAVAILABLE'
  | 'DEADLINE_EXCEEDED'
  | 'UNAUTHENTICATED';

/** Who produces a code (see the file comment). */
export type CodeSource = 'daemon' | 'backend' | 'session' | 'client';

export interface ErrorCodeDeclaration {
  readonly status: StatusName;
  readonly by: CodeSource;
  readonly meaning: string;
}

const daemon = <S extends StatusName>(status: S, meaning: string) => ({ status, by: 'daemon' as const, meaning });
const backend = <S extends StatusName>(status: S, meaning: string) => ({ status, by: 'backend' as const, meaning });
const session = <S extends StatusName>(status: S, meaning: string) => ({ status, by: 'session' as const, meaning });
const client = <S extends StatusName>(status: S, meaning: string) => ({ status, by: 'client' as const, meaning });

/** Every code, by name. */
export const ERROR_CODES = {
  // Arguments
  ZERO_SIZE: daemon('INVALID_ARGUMENT', 'a size or length of 0 where bytes are needed'),
  NOT_ALIGNED: daemon('INVALID_ARGUMENT', 'an address, size or offset not a multiple of the granularity'),
  BAD_ALIGNMENT: daemon('INVALID_ARGUMENT', 'a reservation alignment that is not a power of two'),
  ALIGNMENT_TOO_LARGE: daemon('OUT_OF_RANGE', 'a reservation alignment larger than the largest reservation'),
  BAD_ENUM: daemon('INVALID_ARGUMENT', 'an enum value the daemon does not know, or UNSPECIFIED where one is needed'),
  BAD_LOCATION: daemon('INVALID_ARGUMENT', 'a location that contradicts itself (a device UUID on a location that is not a device)'),
  BAD_NAME: daemon('INVALID_ARGUMENT', 'a store name longer than 255 characters'),
  BAD_TRANSFER: daemon('INVALID_ARGUMENT', 'a transfer id that is not a decimal number of this session'),
  BAD_VALUE: daemon('INVALID_ARGUMENT', 'a fill value outside 0..255'),
  BAD_DESCRIPTOR: daemon('INVALID_ARGUMENT', 'a descriptor or fabric handle that is not memory of the right kind or size'),
  DUPLICATE_LOCATION: daemon('INVALID_ARGUMENT', 'one location named twice in a SetAccess'),
  NONZERO_OFFSET: daemon('INVALID_ARGUMENT', 'a Map offset other than 0 (the driver maps allocations whole)'),
  NO_DESCRIPTORS: daemon('INVALID_ARGUMENT', 'a SetAccess with no access descriptors'),
  NO_SPAN: daemon('INVALID_ARGUMENT', 'a store span naming neither an address nor a store'),
  NO_STORE: daemon('INVALID_ARGUMENT', 'a store reference naming neither an id nor a name'),
  PARTIAL_FREE: daemon('INVALID_ARGUMENT', 'a FreeAddress of part of a reservation'),
  PARTIAL_MAPPING: daemon('INVALID_ARGUMENT', 'a SetAccess over part of a mapping'),
  PARTIAL_UNMAP: daemon('INVALID_ARGUMENT', 'an Unmap of part of a mapping'),
  // Ranges
  UNKNOWN_DEVICE: daemon('OUT_OF_RANGE', 'a device index or UUID the backend does not have'),
  BEYOND_ALLOCATION: daemon('OUT_OF_RANGE', 'a range past the end of its allocation'),
  BEYOND_RESERVATION: daemon('OUT_OF_RANGE', 'a range past the end of its reservation'),
  BEYOND_STAGING: daemon('OUT_OF_RANGE', "a range past the end of the session's staging buffer"),
  BEYOND_STORE: daemon('OUT_OF_RANGE', 'a range past the end of its store'),
  RESERVATION_TOO_LARGE: daemon('OUT_OF_RANGE', 'a reservation larger than the daemon allows'),
  TOO_MANY_SIZES: daemon('OUT_OF_RANGE', 'an AllocateAll naming more allocations than MAX_ALLOCATE_ALL_SIZES'),
  BEYOND_DEVICE: daemon('OUT_OF_RANGE', 'an AllocateAll asking for more bytes than its device (or host memory) has in all'),
  BAD_DEADLINE: daemon('OUT_OF_RANGE', 'an AllocateAll deadline past MAX_ALLOCATE_ALL_WAIT_MS'),
  // Objects that are not there
  UNKNOWN_ALLOCATION: daemon('NOT_FOUND', 'an allocation id that names no live allocation'),
  UNKNOWN_STORE: daemon('NOT_FOUND', 'a store id or name that names no store'),
  NOT_MAPPED: daemon('NOT_FOUND', 'an address inside a reservation where nothing is mapped'),
  NOT_RESERVED: daemon('NOT_FOUND', 'an address inside no reservation'),
  NAME_TAKEN: daemon('ALREADY_EXISTS', 'a store name already in use'),
  // State
  ALREADY_MAPPED: daemon('FAILED_PRECONDITION', 'a Map over a range that is mapped already'),
  ALREADY_RELEASED: daemon('FAILED_PRECONDITION', 'an allocation already released (its memory lives until its mappings go)'),
  NOT_FULLY_MAPPED: daemon('FAILED_PRECONDITION', 'a copy over a range with holes'),
  NOT_OPEN: daemon('FAILED_PRECONDITION', 'a Close of a store this session has not open'),
  NO_ACCESS: daemon('FAILED_PRECONDITION', 'a read or write through the daemon of a mapping without that access set'),
  NO_CUDA_BACKEND: daemon('FAILED_PRECONDITION', 'a request that needs the cuda backend on a daemon running another'),
  NO_REFERENCE: daemon('FAILED_PRECONDITION', 'a handle reference released that the caller does not hold'),
  NO_SESSION: daemon('FAILED_PRECONDITION', 'a call that passes descriptors, made without a session'),
  NO_STAGING: daemon('FAILED_PRECONDITION', 'a staged read or write before the session opened staging'),
  PEER_ACCESS_UNSUPPORTED: daemon('FAILED_PRECONDITION', 'a SetAccess for devices that cannot reach each other'),
  READ_ONLY_MEMORY: daemon('FAILED_PRECONDITION', 'a change to an allocation that backs a read-only store'),
  RESERVATION_MAPPED: daemon('FAILED_PRECONDITION', 'a FreeAddress of a reservation that still has mappings'),
  STORE_DETACHED: daemon('FAILED_PRECONDITION', 'a store detached while the call used it'),
  STORE_READ_ONLY: daemon('FAILED_PRECONDITION', 'a write into a read-only store'),
  TRANSFER_USED: daemon('FAILED_PRECONDITION', 'a transfer id already used in this session'),
  UNSUPPORTED_HANDLE_TYPE: daemon('FAILED_PRECONDITION', 'a handle type the device, allocation or backend does not offer'),
  WRITABLE_MAPPINGS: daemon('FAILED_PRECONDITION', 'a read-only store over an allocation mapped writable'),
  NOT_REOPENABLE: daemon('FAILED_PRECONDITION', 'memory the daemon cannot reopen read-only to hand out (a client memfd it may not open, an unreadable import)'),
  // Who may
  BAD_SHARE_KEY: daemon('PERMISSION_DENIED', "a share key that does not match the allocation's"),
  NEEDS_ADMIN: daemon('PERMISSION_DENIED', 'a daemon-wide call by a caller that is not an admin'),
  NOT_ALLOWED: daemon('PERMISSION_DENIED', 'a peer not on the allow lists'),
  NOT_OWNER: daemon('PERMISSION_DENIED', 'an object of another session or uid'),
  NOT_STORE_WRITER: daemon('PERMISSION_DENIED', 'a write into a store by a session that did not attach it'),
  SESSION_OF_ANOTHER_UID: daemon('PERMISSION_DENIED', "a session token of another uid's session"),
  TCP_INSPECTION_ONLY: daemon('PERMISSION_DENIED', 'a call over TCP that is not inspection, without a client certificate'),
  TCP_SESSION: daemon('UNAUTHENTICATED', 'a session token over TCP, where no session can be'),
  UNKNOWN_SESSION: daemon('UNAUTHENTICATED', 'a session token that names no open session'),
  SESSION_CLOSING: daemon('UNAUTHENTICATED', 'a session token of a session being closed (its reclaim still running)'),
  RESUME_OF_ANOTHER_UID: session('PERMISSION_DENIED', "a resume token presented by a peer of another uid than the session's"),
  // Limits
  QUOTA_EXCEEDED: daemon('RESOURCE_EXHAUSTED', "an allocation past the uid's or session's quota"),
  DAEMON_MAP_FAILED: daemon(
    'RESOURCE_EXHAUSTED',
    "the daemon's own mapping of memory failed (its address space or map count): nothing of the client's is at fault",
  ),
  BUDGET_EXCEEDED: daemon('RESOURCE_EXHAUSTED', 'more objects of a kind (reservations, stores, opens…) than one holder may keep'),
  FELL_BEHIND: daemon('RESOURCE_EXHAUSTED', 'a store watcher that fell behind the events queued for it'),
  READER_STALLED: daemon('RESOURCE_EXHAUSTED', 'a stream reader that took nothing for --stream-stall-ms'),
  // Time and the session
  TRANSFER_NOT_RECEIVED: daemon('DEADLINE_EXCEEDED', 'no descriptor arrived for the transfer id within --transfer-wait-ms'),
  DEADLINE_PASSED: daemon(
    'DEADLINE_EXCEEDED',
    'a call whose deadline passed (or that its client cancelled) while it waited for its turn (not run) or while it ran (what it made undone)',
  ),
  SESSION_CLOSED: daemon('UNAVAILABLE', 'the session closed while the call waited for it'),
  SESSION_SOCKET_FULL: daemon('UNAVAILABLE', 'the session socket is full: the client is not reading it'),
  SESSION_RESUMING: daemon('UNAVAILABLE', 'a session token of a session that waits for its client to resume it after a restart: resume it, then call again'),

  // Backend and operating-system codes, mapped as they cross the wire
  OUT_OF_MEMORY: backend('RESOURCE_EXHAUSTED', "the host backend's capacity is used up, or an AllocateAll's memory was not freed before its deadline"),
  ENOMEM: backend('RESOURCE_EXHAUSTED', 'the kernel has no memory for the request'),
  EMFILE: backend('RESOURCE_EXHAUSTED', 'the daemon is out of descriptors'),
  ENFILE: backend('RESOURCE_EXHAUSTED', 'the system is out of descriptors'),
  ENOSPC: backend('RESOURCE_EXHAUSTED', 'no space left for a memfd'),
  ETOOMANYREFS: backend('RESOURCE_EXHAUSTED', 'too many descriptors in flight on a socket'),
  ENOBUFS: backend('RESOURCE_EXHAUSTED', 'the kernel had no buffer for a session-socket message'),
  MEMORY_SEALED: backend(
    'FAILED_PRECONDITION',
    'memory a client sealed (F_SEAL_WRITE, F_SEAL_SEAL…) through a descriptor it was given refuses what the seals forbid',
  ),
  EAGAIN: backend('UNAVAILABLE', 'the operating system asks to try again'),
  EPIPE: backend('UNAVAILABLE', 'the peer closed its end'),
  ECONNRESET: backend('UNAVAILABLE', 'the peer reset the connection'),
  CUDA_ERROR_OUT_OF_MEMORY: backend('RESOURCE_EXHAUSTED', 'the device has no memory for the request'),
  CUDA_ERROR_INVALID_VALUE: backend('INVALID_ARGUMENT', 'the driver refused an argument'),
  CUDA_ERROR_INVALID_DEVICE: backend('OUT_OF_RANGE', 'the driver does not know the device'),
  CUDA_ERROR_NOT_SUPPORTED: backend('FAILED_PRECONDITION', 'the driver or device does not support the operation'),
  CUDA_ERROR_NOT_PERMITTED: backend('PERMISSION_DENIED', 'the driver does not permit the operation (fabric handles without IMEX)'),
  CUDA_UNAVAILABLE: backend('FAILED_PRECONDITION', 'no usable CUDA driver: the daemon stops at start with --backend cuda'),

  // Session-socket error frames, answering no RPC
  PERMISSION_DENIED: session('PERMISSION_DENIED', 'a peer refused a session (allow lists)'),
  TOO_MANY_SESSIONS: session('RESOURCE_EXHAUSTED', 'a uid holding --max-sessions-per-uid sessions already'),
  OUT_OF_DESCRIPTORS: session('RESOURCE_EXHAUSTED', 'the daemon cannot accept a session or receive a descriptor now'),
  MESSAGE_TOO_LARGE: session('INVALID_ARGUMENT', 'a session message longer than 4096 bytes'),
  TOO_MANY_DESCRIPTORS: session('INVALID_ARGUMENT', 'a session message carrying more than one descriptor'),
  BAD_MESSAGE: session('INVALID_ARGUMENT', 'a session message that is not a known, well-formed frame'),
  UNEXPECTED_DESCRIPTOR: session('INVALID_ARGUMENT', 'a descriptor on a message other than a transfer'),
  NO_DESCRIPTOR: session('INVALID_ARGUMENT', 'a transfer message that carries no descriptor'),
  TOO_MANY_TRANSFERS: session('RESOURCE_EXHAUSTED', 'more unclaimed descriptors than a session or uid may hold'),
  PROTOCOL_VERSION: session('FAILED_PRECONDITION', "a client of another session protocol than the daemon's (the message names the one it needs)"),
  RESUME_UNKNOWN: session(
    'NOT_FOUND',
    'a resume token that names no session waiting for its client (never given, already resumed, or of a daemon that kept no state)',
  ),
  SESSION_RECLAIMED: session('NOT_FOUND', 'a resume token of a session not resumed within --parked-grace-ms: its objects were reclaimed'),
  RESUME_DUPLICATE: session('FAILED_PRECONDITION', 'parked records that repeat a session already open or waiting for its client'),
  FREE_FAILED: session('INTERNAL', 'a released allocation whose memory could not be freed yet; the daemon retries'),

  // Made by the client libraries themselves
  SESSION_LOST: client('UNAVAILABLE', "the client's session socket closed"),
  DAEMON_UNREACHABLE: client('UNAVAILABLE', 'no daemon answers on the socket directory'),
  NO_GREETING: client('DEADLINE_EXCEEDED', 'the daemon sent no hello in time'),
  HELLO_LATE: client('UNAVAILABLE', "the daemon took this client's hello, come late, for the silence of a client of protocol 1 (each connect tries 3 times)"),
  BAD_GREETING: client('UNAVAILABLE', "the daemon's hello is not one this client reads"),
  NO_ANSWER: client('DEADLINE_EXCEEDED', 'no answer to a session request in time'),
  BAD_ANSWER: client('INTERNAL', 'a session answer this client cannot read'),
  FORKED: client('FAILED_PRECONDITION', 'a session used in a child of the process that opened it'),
  CLIENT_CLOSED: client('FAILED_PRECONDITION', 'a call on a closed client'),
  CLOSED: client('FAILED_PRECONDITION', 'a call on closed memory'),
  ASLEEP: client(
    'FAILED_PRECONDITION',
    'memory or a pool used while asleep (its ranges reserved, nothing mapped: a copy into or out of it, an allocation), or a sleep or wake of a pool not in the state it needs',
  ),
  CONTEXT_CLOSED: client('FAILED_PRECONDITION', 'a call on a closed context'),
  POOL_CLOSED: client('FAILED_PRECONDITION', 'a call on a closed pool'),
  ALREADY_FREED: client('FAILED_PRECONDITION', 'a device array freed twice'),
  DOUBLE_FREE: client('FAILED_PRECONDITION', 'a pool block freed twice'),
  NOT_ASLEEP: client('FAILED_PRECONDITION', 'a wake or resume of memory or a tag that is not asleep'),
  BAD_SLEEP_MODE: client('INVALID_ARGUMENT', "a sleep mode other than 'offload' or 'discard', or a sleep level other than 1 or 2"),
  BAD_TAG: client('INVALID_ARGUMENT', 'a sleep tag that is not a non-empty string'),
  BAD_OPTION: client('INVALID_ARGUMENT', 'a connect() option out of its range'),
  BAD_STAGING_SIZE: client('INVALID_ARGUMENT', 'a staging size that is not 0 or a positive multiple of twice the page size'),
  BAD_CONFIG: client('INVALID_ARGUMENT', 'a context or pool setting out of its range'),
  BAD_SHAPE: client('INVALID_ARGUMENT', 'an array shape the client cannot make'),
  BAD_INDEX: client('INVALID_ARGUMENT', 'an index outside an array'),
  BAD_DEVICE: client('FAILED_PRECONDITION', 'a device the context cannot use'),
  BAD_DTYPE: client('INVALID_ARGUMENT', 'a dtype the client cannot map'),
  BAD_ID: client('INVALID_ARGUMENT', 'an id that is not a number'),
  BAD_REQUEST: client('INVALID_ARGUMENT', 'a request the client refuses before sending'),
  BAD_SIZE: client('INVALID_ARGUMENT', 'a size that is not a positive integer'),
  BAD_STORE: client('INVALID_ARGUMENT', 'a store reference the client cannot read'),
  BAD_STREAM: client('INVALID_ARGUMENT', 'a stream that is neither a CUstream handle nor an object holding one in `.ptr`'),
  BAD_TIMEOUT: client('INVALID_ARGUMENT', 'a timeout that is not a positive number'),
  BAD_MEMORY_MANAGER: client('FAILED_PRECONDITION', 'a memory-manager module without a usable export'),
  MANAGER_IN_USE: client('FAILED_PRECONDITION', 'a memory manager replaced while it holds memory'),
  NOT_MANAGED: client('FAILED_PRECONDITION', 'memory not made by this memory manager'),
  CONFIG_FROZEN: client('FAILED_PRECONDITION', 'a context setting changed after first use'),
  NO_DATA_PATH: client('FAILED_PRECONDITION', 'a context with no way to move bytes'),
  NO_CUDA: client('FAILED_PRECONDITION', 'a client-side CUDA call where libcuda is not loaded'),
  NO_HOST_VIEW: client('FAILED_PRECONDITION', 'memory the process cannot see at a host address'),
  NO_COMPILER: client('FAILED_PRECONDITION', 'no C compiler to build the PyTorch allocator'),
  NO_CACHE_DIR: client('FAILED_PRECONDITION', 'the Python package cannot write the cache its allocation library is built into (VMMD_CACHE_DIR)'),
  BAD_IDLE_SECONDS: client('INVALID_ARGUMENT', "a pool's idle time (VMMD_POOL_IDLE_SECONDS, idle_seconds=) that is not a finite number of seconds >= 0"),
  BAD_REFILL_SECONDS: client('INVALID_ARGUMENT', "vmmd.torch's refill wait (VMMD_TORCH_REFILL_SECONDS) that is not a finite number of seconds > 0"),
  NO_MEMORY: client('RESOURCE_EXHAUSTED', 'the PyTorch allocation library could not record a chunk (out of host memory)'),
  NO_MEMPOOL: client('FAILED_PRECONDITION', 'a CuPy without the memory-pool interface'),
  NO_BUFFER: client('INVALID_ARGUMENT', 'an object that exposes no buffer'),
  NOT_SHAREABLE: client('INVALID_ARGUMENT', 'memory that cannot be shared across processes'),
  NOT_VMMD_MEMORY: client('NOT_FOUND', 'a pointer that is not memory this client mapped'),
  READ_ONLY: client('FAILED_PRECONDITION', 'a write into read-only memory'),
  READ_ONLY_BUFFER: client('INVALID_ARGUMENT', 'a read into a buffer that cannot be written'),
  SHARE_KEY_TOO_LONG: client('INVALID_ARGUMENT', 'a share key longer than 256 characters'),
  VIEWS_ALIVE: client('FAILED_PRECONDITION', 'memory closed while views of it are alive'),
  LOCAL_MAP_FAILED: client('INTERNAL', 'mapping a descriptor into the process failed'),
  UNSUPPORTED_LOCATION: client('INVALID_ARGUMENT', 'a location kind the client does not offer'),
  UNKNOWN_BACKEND: client('UNIMPLEMENTED', 'a backend this client does not know how to map'),
  FILE_CHANGED: client('ABORTED', 'a file that changed while it was copied'),
  EISDIR: client('INVALID_ARGUMENT', 'a directory named where vmmctl reads or writes a file'),
  INVALID_ARGUMENT: client('INVALID_ARGUMENT', 'an argument the client refuses'),
} as const satisfies Record<string, ErrorCodeDeclaration>;

/** A declared code: a misspelt one does not compile. */
export type ErrorCode = keyof typeof ERROR_CODES;

/** The codes declared with `status`. */
export type CodeWithStatus<S extends StatusName> = {
  [C in ErrorCode]: (typeof ERROR_CODES)[C]['status'] extends S ? C : never;
}[ErrorCode];

/** Whether `code` is declared. */
export function isErrorCode(code: unknown): code is ErrorCode {
  return typeof code === 'string' && Object.prototype.hasOwnProperty.call(ERROR_CODES, code);
}
