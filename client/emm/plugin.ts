/**
 * Which memory manager a process uses, as Numba selects its EMM plugin:
 * setMemoryManager(cls), or VMMD_MEMORY_MANAGER naming a module (like
 * NUMBA_CUDA_MEMORY_MANAGER) that exports the class as `_numba_memory_manager`,
 * `memoryManager` or `default`. The choice is fixed once memory was allocated.
 */
import { status as Status } from '@grpc/grpc-js';
import * as path from 'node:path';
import { VmmdError } from '../errors';
import type { BaseMemoryManager } from './base';
import type { ManagerContext } from './memory';

export type MemoryManagerClass<C extends ManagerContext = ManagerContext> = new (context: C) => BaseMemoryManager;

export const MEMORY_MANAGER_VARIABLE = 'VMMD_MEMORY_MANAGER';

let chosen: MemoryManagerClass | undefined;
let allocated = false;

/** Managers call this when they hand out memory: from then on the choice is fixed. */
export function noteAllocation(): void {
  allocated = true;
}

/**
 * Uses `cls` for every context created from now on.
 * @throws VmmdError PROGRAM_ERROR MANAGER_IN_USE once memory was allocated
 */
// eslint-disable-next-line @typescript-eslint/no-explicit-any -- any context type: the manager is the caller's
export function setMemoryManager(cls: MemoryManagerClass<any>): void {
  if (allocated) {
    throw new VmmdError('MANAGER_IN_USE', Status.FAILED_PRECONDITION, 'the memory manager cannot change once memory was allocated');
  }
  if (process.env[MEMORY_MANAGER_VARIABLE]) {
    process.emitWarning(`setMemoryManager() overrides ${MEMORY_MANAGER_VARIABLE}=${process.env[MEMORY_MANAGER_VARIABLE]}`, 'VmmdMemoryManagerWarning');
  }
  chosen = cls;
}

/** Forgets the choice (tests, and processes that start over). */
export function resetMemoryManagerChoice(): void {
  chosen = undefined;
  allocated = false;
}

/**
 * Makes the chosen manager for a context. Its allocating methods note the
 * first allocation, so that the choice is fixed from then on, whatever class it is.
 */
export function createMemoryManager<C extends ManagerContext>(context: C, fallback: MemoryManagerClass<C>): BaseMemoryManager {
  const Manager = memoryManagerClass(fallback);
  const manager = new Manager(context);
  for (const method of ['memalloc', 'memhostalloc', 'mempin'] as const) {
    const original = manager[method].bind(manager) as (...args: unknown[]) => Promise<unknown>;
    (manager as unknown as Record<string, unknown>)[method] = (...args: unknown[]) => {
      noteAllocation();
      return original(...args);
    };
  }
  return manager;
}

/**
 * The class to use: the one set, else the one the environment names, else `fallback`.
 * @throws VmmdError PROGRAM_ERROR BAD_MEMORY_MANAGER when the module cannot be loaded or exports no class
 */
export function memoryManagerClass<C extends ManagerContext>(fallback: MemoryManagerClass<C>): MemoryManagerClass<C> {
  if (chosen !== undefined) return chosen as MemoryManagerClass<C>;
  const name = process.env[MEMORY_MANAGER_VARIABLE];
  if (!name) return fallback;
  let loaded: Record<string, unknown>;
  try {
    // eslint-disable-next-line @typescript-eslint/no-require-imports -- the manager's module is named at run time
    loaded = require(name.startsWith('.') ? path.resolve(name) : name);
  } catch (error) {
    throw new VmmdError('BAD_MEMORY_MANAGER', Status.FAILED_PRECONDITION, `${MEMORY_MANAGER_VARIABLE}=${name} cannot be loaded: ${(error as Error).message}`);
  }
  const cls = loaded._numba_memory_manager ?? loaded.memoryManager ?? loaded.default;
  if (typeof cls !== 'function') {
    throw new VmmdError(
      'BAD_MEMORY_MANAGER',
      Status.FAILED_PRECONDITION,
      `${MEMORY_MANAGER_VARIABLE}=${name} exports no memory manager class (_numba_memory_manager, memoryManager or default)`,
    );
  }
  return cls as MemoryManagerClass<C>;
}
