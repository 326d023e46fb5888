/**
 * The native calls the published client library makes, and no others: a
 * small typed module over the addon. What maps memory into the process goes
 * through native/mapping.ts (which only maps into a range it reserved
 * itself), the session socket through native/seqpacket.ts; anything else the
 * addon has (hostMap at any address, fault injection, the daemon's calls)
 * is out of the client's reach. test/unit/client-surface.test.ts checks
 * that client/ imports the addon through these three modules only.
 */
import { addon, Addon } from './index';

export { CU_HANDLE, CU_LOCATION } from './index';
export type { CudaDeviceInfo, CudaLoadResult, NativeError } from './index';

const CLIENT_CALLS = [
  'close',
  'dup',
  'pageSize',
  'addressOf',
  'hostMemfdCreate',
  'hostCopyPieces',
  'hostPopulate',
  'hostLock',
  'hostUnlock',
  'cudaLoad',
  'cudaDevices',
  'cudaGranularity',
  'cudaCreate',
  'cudaRelease',
  'cudaExportFd',
  'cudaImportFd',
  'cudaImportFabric',
  'cudaCopyToDevice',
  'cudaCopyFromDevice',
  'cudaCopyPieces',
  'cudaSynchronize',
  'cudaHostRegister',
  'cudaHostUnregister',
] as const;

export type ClientCalls = Pick<Addon, (typeof CLIENT_CALLS)[number]>;

// The addon loads the driver once per process, and its answer never changes: asked once (each
// ask builds an object in the addon, and a cold allocation asked twice).
let driverLoad: ReturnType<Addon['cudaLoad']> | undefined;
const cudaLoad = () => (driverLoad ??= Object.freeze(addon.cudaLoad()));

/** The client's calls, bound to the addon; the object holds nothing else. */
export const native: ClientCalls = Object.freeze({
  ...(Object.fromEntries(CLIENT_CALLS.map((name) => [name, (addon[name] as (...args: unknown[]) => unknown).bind(addon)])) as unknown as ClientCalls),
  cudaLoad,
});
