/** The Devices service: what memory the daemon owns and how it is carved. */
import * as grpc from '@grpc/grpc-js';
import type { Device } from '../../../../generated/vmmd/v1/Device';
import type { GetGranularityRequest__Output } from '../../../../generated/vmmd/v1/GetGranularityRequest';
import type { GetMemoryInfoRequest__Output } from '../../../../generated/vmmd/v1/GetMemoryInfoRequest';
import type { Granularity } from '../../../../generated/vmmd/v1/Granularity';
import type { ListDevicesResponse } from '../../../../generated/vmmd/v1/ListDevicesResponse';
import type { MemoryInfo } from '../../../../generated/vmmd/v1/MemoryInfo';
import type { VmmdProto } from '../../../../common/proto';
import { outOfRange } from '../../../errors';
import type { Registry } from '../../../registry';
import { HandlerDeps, unary } from './handler';
import { location, toWireHandleType } from '../../wire';

export class DevicesService {
  constructor(private readonly registry: Registry) {}

  listDevices(): ListDevicesResponse {
    const backend = this.registry.backend;
    const devices: Device[] = this.registry.devices.map((device) => {
      const memory = backend.memoryInfo(device.index);
      return {
        index: device.index,
        name: device.name,
        kind: device.kind === 'CUDA' ? 'DEVICE_KIND_CUDA' : 'DEVICE_KIND_HOST',
        uuid: device.uuid,
        totalBytes: String(memory.totalBytes),
        freeBytes: String(memory.freeBytes),
        granularityMinimum: String(device.granularityMinimum),
        granularityRecommended: String(device.granularityRecommended),
        handleTypes: device.handleTypes.map(toWireHandleType),
        computeCapability: device.computeCapability,
        fabricUsable: device.fabricUsable,
        fabricStatus: device.fabricStatus,
        hostNumaId: device.hostNumaId,
      };
    });
    return { devices, backend: backend.name };
  }

  /** @throws OUT_OF_RANGE UNKNOWN_DEVICE */
  getMemoryInfo(request: GetMemoryInfoRequest__Output): MemoryInfo {
    if (request.deviceUuid !== '') request = { ...request, device: this.registry.deviceByUuid(request.deviceUuid) };
    if (request.device >= this.registry.devices.length) {
      throw outOfRange('UNKNOWN_DEVICE', `device ${request.device} does not exist (the daemon has ${this.registry.devices.length} device(s))`);
    }
    const memory = this.registry.backend.memoryInfo(request.device);
    return {
      device: request.device,
      freeBytes: String(memory.freeBytes),
      totalBytes: String(memory.totalBytes),
      allocatedBytes: String(this.registry.allocatedBytes(request.device)),
    };
  }

  /** @throws OUT_OF_RANGE UNKNOWN_DEVICE; INVALID_ARGUMENT BAD_ENUM */
  getGranularity(request: GetGranularityRequest__Output): Granularity {
    const granularity = this.registry.granularity(location(request.location, (uuid, field) => this.registry.deviceByUuid(uuid, field)));
    return { minimum: String(granularity.minimum), recommended: String(granularity.recommended) };
  }

  addToServer(server: grpc.Server, proto: VmmdProto, deps: HandlerDeps): void {
    server.addService(proto.vmmd.v1.Devices.service, {
      ListDevices: unary(deps, 'ListDevices', () => this.listDevices()),
      GetMemoryInfo: unary(deps, 'GetMemoryInfo', (request: GetMemoryInfoRequest__Output) => this.getMemoryInfo(request)),
      GetGranularity: unary(deps, 'GetGranularity', (request: GetGranularityRequest__Output) => this.getGranularity(request)),
    });
  }
}
