/**
 * The vmmd client library: `import { connect } from 'vmmd'`.
 */
export { connect, VmmdClient, DevicesApi, AdminApi } from './connection';
export type { ConnectOptions } from './connection';
export { VmmdError } from './errors';
export { CudaImportedMemory, HostImportedMemory, ImportedMemory, mapFabricHandle } from './local-memory';
export type { CudaSource } from './local-memory';
export { ClientSession } from './session';
export { VirtualMemoryApi } from './vmm';
export type { ImportOptions } from './vmm';
export { defaultSocketDir } from '../common/paths';
