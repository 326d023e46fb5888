/**
 * Conversions, for both transports, between the wire's shapes (uint64 as decimal strings, enums as
 * names) and the registry's (bigint, short names). Unknown enum values are
 * the caller's error, named with the field.
 */
import type { AccessDescriptor__Output } from '../../generated/vmmd/v1/AccessDescriptor';
import type { Location, Location__Output } from '../../generated/vmmd/v1/Location';
import { Access, AccessGrant, BackendCapabilities, HandleKind, LocationKind, MemLocation } from '../backends/backend';
import type { Store } from '../../generated/vmmd/v1/Store';
import type { Capability__Output } from '../../generated/vmmd/v1/Capability';
import { invalidArgument } from '../errors';
import type { StoreRecord } from '../stores/stores';

export function u64(value: string | number | undefined): bigint {
  return BigInt(value ?? 0);
}

const LOCATION_TYPES: Record<string, LocationKind> = {
  LOCATION_TYPE_UNSPECIFIED: 'DEVICE',
  LOCATION_TYPE_DEVICE: 'DEVICE',
  LOCATION_TYPE_HOST: 'HOST',
  LOCATION_TYPE_HOST_NUMA: 'HOST_NUMA',
};

/** Resolves a device UUID to its index; the registry checks indexes. */
export type DeviceResolver = (uuid: string, field: string) => number;

export function location(value: Location__Output | null | undefined, resolve: DeviceResolver, field = 'location'): MemLocation {
  if (value === null || value === undefined) return { type: 'DEVICE', id: 0 };
  const type = LOCATION_TYPES[String(value.type)];
  if (type === undefined) throw invalidArgument('BAD_ENUM', `${field}.type ${JSON.stringify(value.type)} is not a LocationType`);
  if (value.deviceUuid !== '') {
    if (type !== 'DEVICE') throw invalidArgument('BAD_LOCATION', `${field}.device_uuid names a device; ${field}.type is ${type}`);
    return { type, id: resolve(value.deviceUuid, `${field}.device_uuid`) };
  }
  return { type, id: value.id };
}

export function toWireLocation(value: MemLocation): Location {
  return { type: `LOCATION_TYPE_${value.type}`, id: value.id, deviceUuid: '' };
}

export function handleType(value: string | number | undefined, field = 'handle_type'): HandleKind {
  switch (value) {
    case undefined:
    case 'HANDLE_TYPE_UNSPECIFIED':
    case 'HANDLE_TYPE_POSIX_FD':
      return 'POSIX_FD';
    case 'HANDLE_TYPE_FABRIC':
      return 'FABRIC';
    default:
      throw invalidArgument('BAD_ENUM', `${field} ${JSON.stringify(value)} is not a HandleType`);
  }
}

export function toWireHandleType(value: HandleKind): 'HANDLE_TYPE_POSIX_FD' | 'HANDLE_TYPE_FABRIC' {
  return `HANDLE_TYPE_${value}`;
}

const ACCESS: Record<string, Access> = { ACCESS_FLAGS_NONE: 0, ACCESS_FLAGS_READ: 1, ACCESS_FLAGS_READWRITE: 3 };

export function accessGrant(value: AccessDescriptor__Output, index: number, resolve: DeviceResolver): AccessGrant {
  const access = ACCESS[String(value.flags)];
  if (access === undefined) {
    throw invalidArgument('BAD_ENUM', `descriptors[${index}].flags ${JSON.stringify(value.flags)} is not an AccessFlags`);
  }
  return { location: location(value.location, resolve, `descriptors[${index}].location`), access };
}

export function toWireAccess(value: Access): 'ACCESS_FLAGS_NONE' | 'ACCESS_FLAGS_READ' | 'ACCESS_FLAGS_READWRITE' {
  return value === 3 ? 'ACCESS_FLAGS_READWRITE' : value === 1 ? 'ACCESS_FLAGS_READ' : 'ACCESS_FLAGS_NONE';
}

/** A store as the Store message describes it. */
export function toWireStore(store: StoreRecord): Store {
  let opens = 0;
  for (const count of store.opens.values()) opens += count;
  return {
    id: String(store.id),
    name: store.name,
    target: `STORE_TARGET_${store.target}`,
    device: store.device,
    size: String(store.size),
    readOnly: store.readOnly,
    attached: store.attached,
    ownerSession: String(store.owner),
    state: `STORE_STATE_${store.state}`,
    opens,
    allocationId: String(store.memory.allocationId),
  };
}

/** What the daemon can do, as the hello tells clients (session.proto's Capability): they ask for these, not for a backend's name. */
export function toWireCapabilities(capabilities: BackendCapabilities): Capability__Output[] {
  return [
    capabilities.descriptors === 'cuda' ? 'CAPABILITY_CUDA_DESCRIPTORS' : 'CAPABILITY_MEMFD_DESCRIPTORS',
    ...(capabilities.gpuMemory ? (['CAPABILITY_ATTACH_DEVICE_MEMORY'] as const) : []),
    ...(capabilities.hostNumaNodes ? (['CAPABILITY_HOST_NUMA'] as const) : []),
    ...(capabilities.readOnlyExports ? (['CAPABILITY_READ_ONLY_DESCRIPTORS'] as const) : []),
  ];
}
