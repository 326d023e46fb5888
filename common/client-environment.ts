/**
 * The environment variables the client libraries read, in one table: what
 * each does, its default and which library reads it. docs/CONFIGURATION.md's
 * "Clients" section is generated from it (scripts/gen-declared.js); the
 * readers stay where the variable is used.
 */

export interface EnvironmentSwitch {
  /** Which client reads it. */
  readBy: 'both' | 'typescript' | 'python';
  default: string;
  meaning: string;
}

export const CLIENT_ENVIRONMENT = {
  VMMD_SOCKET_DIR: { readBy: 'both', default: "the daemon's default directory", meaning: "where `connect()` finds the daemon's sockets" },
  XDG_RUNTIME_DIR: {
    readBy: 'both',
    default: 'unset',
    meaning: 'part of the default socket directory: `$XDG_RUNTIME_DIR/vmmd` where `/run/vmmd` is not usable',
  },
  VMMD_CLIENT_BUSY_POLL_US: {
    readBy: 'both',
    default: '200',
    meaning: 'how long a client spins for its answer before it sleeps (0 to 10000; 0: never); `connect({ busyPollMicros })`, `vmmd.connect(busy_poll_us=...)`',
  },
  VMMD_RESUME_WAIT_MS: {
    readBy: 'both',
    default: '30000',
    meaning:
      "after the session socket closes under a daemon that parks its sessions, how long a client tries to resume its session (the daemon's `--parked-grace-ms` is how long the daemon waits); `connect({ resumeWaitMs })`, `vmmd.connect(resume_wait_ms=...)`; `0`: never resume",
  },
  VMMD_MEMORY_MANAGER: {
    readBy: 'typescript',
    default: 'none',
    meaning:
      'the module whose `_numba_memory_manager`, `memoryManager` or `default` export is the NBEP 7 manager ([CLIENT.md](CLIENT.md#numbas-emm-interface-futhark-style-contexts-device-arrays))',
  },
  VMMD_ADDRESS_ARENA: {
    readBy: 'typescript',
    default: 'on',
    meaning: "`off` gives each mapping a reservation of its own instead of ranges of the process's arena",
  },
  VMMD_ADDON: { readBy: 'typescript', default: "the package's", meaning: 'the path of a built `vmmd_native.node` to load instead' },
  VMMD_DRIVER_TRACE: {
    readBy: 'typescript',
    default: 'off',
    meaning: '`1`: one stderr line per driver call (the daemon reads it too), for `bench/cold_timeline.py`',
  },
  VMMD_FAULTS: {
    readBy: 'typescript',
    default: 'none',
    meaning: 'fault injection at load: driver calls that fail once (`native/src/faults.h`; RELIABILITY.md); the daemon reads it too',
  },
  NUMBA_CUDA_MEMORY_MANAGER: { readBy: 'python', default: 'none', meaning: "Numba's own switch: `vmmd.numba` makes Numba allocate through the daemon" },
  VMMD_NUMBA_CHUNK_BYTES: { readBy: 'python', default: '32 MiB', meaning: "the chunk size of `vmmd.numba`'s pool" },
  VMMD_NUMBA_LARGE_BYTES: { readBy: 'python', default: '16 MiB', meaning: 'the size from which `vmmd.numba` gives a request an allocation of its own' },
  VMMD_NUMBA_PREPARE_COPIES: {
    readBy: 'python',
    default: '0',
    meaning: "1: `vmmd.numba`'s pool makes each chunk's host copy for an offload sleep ahead and keeps it while awake (`DevicePool(prepare_copies=True)`)",
  },
  VMMD_CACHE_DIR: { readBy: 'python', default: '`~/.cache/vmmd`', meaning: 'where the PyTorch allocator library is built and kept' },
  CC: { readBy: 'python', default: '`cc`', meaning: 'the C compiler that builds the PyTorch allocator library' },
  VMMD_POOL_IDLE_SECONDS: {
    readBy: 'python',
    default: '10',
    meaning:
      'how long a pool (`vmmd.cupy`, `vmmd.numba`, `DevicePool`) keeps free chunks before it gives them back to the daemon (0: never); `idle_seconds=` on the pool',
  },
  VMMD_TORCH_REFILL_SECONDS: {
    readBy: 'python',
    default: '5',
    meaning: "how long `vmmd.torch`'s malloc, past the room leased ahead, waits for the package's thread to lease more before PyTorch's out-of-memory error",
  },
} as const satisfies Record<string, EnvironmentSwitch>;
