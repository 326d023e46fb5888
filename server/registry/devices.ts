/**
 * The devices the registry serves and the one rule about naming them: a
 * location's device must exist, and host memory names NUMA nodes only where
 * the backend has them (a capability, not the backend's name).
 */
import { Backend, describeLocation, DeviceInfo, MemLocation } from '../backends/backend';
import { outOfRange } from '../errors';

export class DeviceTable {
  readonly list: readonly DeviceInfo[];
  /** A reservation may hold memory of any device, so it follows the coarsest one. */
  readonly reservationGranularity: bigint;

  constructor(private readonly backend: Backend) {
    this.list = backend.devices();
    this.reservationGranularity = this.list.reduce((coarsest, device) => (device.granularityMinimum > coarsest ? device.granularityMinimum : coarsest), 1n);
  }

  /**
   * The index of the device with this UUID.
   * @throws OUT_OF_RANGE UNKNOWN_DEVICE
   */
  byUuid(uuid: string, field = 'device_uuid'): number {
    const device = this.list.find((candidate) => candidate.uuid !== '' && candidate.uuid === uuid);
    if (device === undefined) {
      throw outOfRange('UNKNOWN_DEVICE', `${field} ${JSON.stringify(uuid.slice(0, 64))} names no device of this daemon`);
    }
    return device.index;
  }

  /**
   * The device whose rules memory at `location` follows (host memory: device 0's).
   * @throws OUT_OF_RANGE UNKNOWN_DEVICE
   */
  deviceOf(location: MemLocation): number {
    if (location.type === 'DEVICE') {
      if (!Number.isInteger(location.id) || location.id < 0 || location.id >= this.list.length) {
        throw outOfRange('UNKNOWN_DEVICE', `device ${location.id} does not exist (the daemon has ${this.list.length} device(s))`);
      }
      return location.id;
    }
    if (location.id !== 0 && !this.backend.capabilities.hostNumaNodes) {
      throw outOfRange('UNKNOWN_DEVICE', `${describeLocation(location)} does not exist on the ${this.backend.name} backend (only id 0)`);
    }
    return 0;
  }

  /** @throws OUT_OF_RANGE UNKNOWN_DEVICE naming the index */
  checkIndex(device: number): void {
    if (device >= this.list.length) {
      throw outOfRange('UNKNOWN_DEVICE', `device ${device} does not exist (the daemon has ${this.list.length} device(s))`);
    }
  }
}
