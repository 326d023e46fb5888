/**
 * Loads the vmmd protos with the one set of options that the generated types
 * were made with (proto/loader-options.json).
 */
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import * as fs from 'node:fs';
import * as path from 'node:path';
import type { ProtoGrpcType as AdminProto } from '../generated/admin';
import type { ProtoGrpcType as DevicesProto } from '../generated/devices';
import type { ProtoGrpcType as StoresProto } from '../generated/stores';
import type { ProtoGrpcType as VirtualMemoryProto } from '../generated/virtual_memory';

function protoRoot(): string {
  let dir = __dirname;
  while (!fs.existsSync(path.join(dir, 'proto', 'loader-options.json'))) {
    const parent = path.dirname(dir);
    if (parent === dir) throw new Error(`cannot find proto/ above ${__dirname}`);
    dir = parent;
  }
  return path.join(dir, 'proto');
}

export const PROTO_DIR = protoRoot();

export const PROTO_FILES = [
  'vmmd/v1/common.proto',
  'vmmd/v1/devices.proto',
  'vmmd/v1/virtual_memory.proto',
  'vmmd/v1/admin.proto',
  'vmmd/v1/stores.proto',
  // The session socket's frames: not a service, but grpcurl's `describe` resolves them through reflection.
  'vmmd/v1/session.proto',
];

/** The options shared with scripts/gen-types.js, with include dirs made absolute. */
export const LOADER_OPTIONS: protoLoader.Options = (() => {
  const options = JSON.parse(fs.readFileSync(path.join(PROTO_DIR, 'loader-options.json'), 'utf8'));
  return {
    ...options,
    longs: String,
    enums: String,
    includeDirs: [PROTO_DIR],
  };
})();

export type VmmdProto = AdminProto & DevicesProto & VirtualMemoryProto & StoresProto;

/**
 * What reflection describes: the vmmd services and grpc.health.v1, so that
 * `grpcurl list` shows (and `describe` resolves) everything the daemon serves.
 */
export function reflectedDefinition(): protoLoader.PackageDefinition {
  const healthProto = require.resolve('grpc-health-check/proto/health/v1/health.proto');
  const healthRoot = path.resolve(path.dirname(healthProto), '..', '..');
  return protoLoader.loadSync([...PROTO_FILES, 'health/v1/health.proto'], { ...LOADER_OPTIONS, includeDirs: [PROTO_DIR, healthRoot] });
}

let loaded: { definition: protoLoader.PackageDefinition; proto: VmmdProto } | undefined;

/** The package definition (for reflection) and the loaded gRPC object. */
export function loadProtos(): { definition: protoLoader.PackageDefinition; proto: VmmdProto } {
  if (loaded === undefined) {
    const definition = protoLoader.loadSync(PROTO_FILES, LOADER_OPTIONS);
    loaded = { definition, proto: grpc.loadPackageDefinition(definition) as unknown as VmmdProto };
  }
  return loaded;
}
