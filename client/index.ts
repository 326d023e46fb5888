/**
 * The vmmd client library: `import { connect } from 'vmmd'`.
 */
export { connect, VmmdClient, DevicesApi, AdminApi } from './connection';
export type { BackendName, ConnectOptions } from './connection';
export { inspect, VmmdInspector } from './inspect';
export type { InspectOptions } from './inspect';
export { VmmdError } from './errors';
export { CudaImportedMemory, HostImportedMemory, ImportedMemory, mapFabricHandle } from './local-memory';
export type { CudaSource } from './local-memory';
export { ClientSession } from './session';
export { VirtualMemoryApi } from './vmm';
export type { ImportOptions } from './vmm';
export { defaultSocketDir } from '../common/paths';
export { ERROR_CODES, ErrorCode } from './errors';
export type { DeclaredCode } from './errors';
export { Config, Context } from './context';
export type { ConfigSettings, UnifiedMemory } from './context';
export { DeviceArray } from './device-array';
export type { TypedArray, TypedArrayClass } from './device-array';
export { DEFAULT_AHEAD } from './emm/ahead';
export type { AheadSettings } from './emm/ahead';
export { BaseMemoryManager, HostOnlyMemoryManager } from './emm/base';
export type { HostAllocOptions } from './emm/base';
export { DEFAULT_DEFERRED_FREE, PendingDeallocations } from './emm/deallocations';
export type { DeferredFreeSettings } from './emm/deallocations';
export { MappedMemory, MemoryPointer, PinnedMemory, onFinalizerError } from './emm/memory';
export type { IpcHandle, ManagerContext, MemoryInfo } from './emm/memory';
export { createMemoryManager, memoryManagerClass, MEMORY_MANAGER_VARIABLE, resetMemoryManagerChoice, setMemoryManager } from './emm/plugin';
export type { MemoryManagerClass } from './emm/plugin';
export { DEFAULT_POOL, sizeClass } from './emm/pool';
export type { PoolSettings } from './emm/pool';
export { VmmdMemoryManager } from './emm/vmmd-manager';
export type { ManagerStats, VmmdManagerContext } from './emm/vmmd-manager';
export { OpenedStore, StoresApi } from './stores';
export type { StoreName } from './stores';
export { AttachedStore, ExternalAllocation, onDeleterError } from './external';
export { LocalDeviceMemory, SharedHostMemory } from './shared-memory';
export type { ExternalOptions } from './external';
