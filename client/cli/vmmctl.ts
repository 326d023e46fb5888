/**
 * vmmctl: the operator's command line for a running vmmd.
 *   vmmctl [--socket-dir DIR] [--json] devices | stats
 *   vmmctl store load NAME FILE [--mutable] [--host]   fill a named store from a file; it outlives this command
 *   vmmctl store dump NAME FILE                        write a store's bytes to a file
 *   vmmctl store ls                                    list stores
 *   vmmctl store rm NAME                               detach: freed once the last reader closes
 */
import { status as Status } from '@grpc/grpc-js';
import * as fs from 'node:fs';
import { parseArgs } from 'node:util';
import { connect, VmmdClient } from '../connection';
import { VmmdError } from '../errors';

const USAGE = `Usage: vmmctl [--socket-dir DIR] [--json] COMMAND
  devices                       the daemon's devices
  stats                         objects, bytes and sessions the daemon holds
  sessions                      open sessions: peer pid, uid, gid and what they hold
  objects [SESSION]             reservations, allocations, mappings, stores (of one session)
  report                        everything, as JSON
  clear-caches                  close descriptors sent and never claimed
  version                       the daemon's version, build and runtime
  store load NAME FILE          fill a new read-only store from FILE (--mutable: writable; --host: host memory on cuda)
  store dump NAME FILE          write the store's bytes to FILE
  store ls                      list stores
  store rm NAME                 detach the store: no new opens, freed when the last reader closes`;

const CHUNK = 8 << 20;
const MiB = 1024 * 1024;

/** A progress bar on stderr: redrawn in place on a terminal, every 10% otherwise. */
class Progress {
  private readonly started = performance.now();
  private lastTenth = -1;

  constructor(
    private readonly label: string,
    private readonly total: number,
  ) {}

  update(done: number): void {
    const fraction = this.total === 0 ? 1 : done / this.total;
    if (process.stderr.isTTY) {
      const width = 30;
      const filled = Math.round(fraction * width);
      process.stderr.write(`\r${this.label} [${'#'.repeat(filled)}${' '.repeat(width - filled)}] ${(fraction * 100).toFixed(0).padStart(3)}% ${(done / MiB).toFixed(1)}/${(this.total / MiB).toFixed(1)} MiB`);
    } else if (Math.floor(fraction * 10) > this.lastTenth) {
      this.lastTenth = Math.floor(fraction * 10);
      process.stderr.write(`${this.label}: ${(fraction * 100).toFixed(0)}% (${(done / MiB).toFixed(1)} of ${(this.total / MiB).toFixed(1)} MiB)\n`);
    }
  }

  finish(verb: string): string {
    const seconds = (performance.now() - this.started) / 1000;
    if (process.stderr.isTTY) process.stderr.write('\n');
    return `${verb} ${(this.total / MiB).toFixed(1)} MiB in ${seconds.toFixed(2)} s (${(this.total / MiB / Math.max(seconds, 1e-9)).toFixed(0)} MiB/s)`;
  }
}

async function load(client: VmmdClient, name: string, file: string, options: { mutable: boolean; host: boolean }): Promise<string> {
  const size = fs.statSync(file).size;
  if (size === 0) throw new VmmdError('ZERO_SIZE', Status.INVALID_ARGUMENT, `${file} is empty: a store holds at least one byte`);
  const location =
    options.host && client.backend === 'cuda' ? { type: 'LOCATION_TYPE_HOST_NUMA' as const, id: 0 } : { type: 'LOCATION_TYPE_DEVICE' as const, id: 0 };
  const granularity = BigInt((await client.devices.getGranularity({ location })).minimum);
  const allocationSize = ((BigInt(size) + granularity - 1n) / granularity) * granularity;
  const allocation = await client.vmm.create({ size: allocationSize, location });
  const memory = await client.vmm.import(allocation.id);
  const progress = new Progress(`load ${name}`, size);
  const fd = fs.openSync(file, 'r');
  try {
    const buffer = Buffer.alloc(CHUNK);
    for (let done = 0; done < size; ) {
      const read = fs.readSync(fd, buffer, 0, Math.min(CHUNK, size - done), done);
      await memory.write(done, buffer.subarray(0, read));
      done += read;
      progress.update(done);
    }
  } finally {
    fs.closeSync(fd);
    await memory.close();
  }
  // The store holds its own reference and belongs to the daemon: it outlives this command.
  const store = await client.stores.createStore({ allocationId: allocation.id, name, readOnly: !options.mutable, handOver: true, size: BigInt(size) });
  await client.vmm.release({ allocationId: allocation.id });
  return `${progress.finish('loaded')} into store ${store.id} "${name}"${options.mutable ? '' : ', read-only'}`;
}

async function dump(client: VmmdClient, name: string, file: string): Promise<string> {
  const opened = await client.stores.open(name, { writable: false });
  const size = Number(opened.store.size);
  const progress = new Progress(`dump ${name}`, size);
  const fd = fs.openSync(file, 'w');
  try {
    for (let done = 0; done < size; ) {
      const length = Math.min(CHUNK, size - done);
      fs.writeSync(fd, await opened.memory.read(done, length));
      done += length;
      progress.update(done);
    }
  } finally {
    fs.closeSync(fd);
    await opened.close();
  }
  return `${progress.finish('dumped')} from store ${opened.store.id} "${name}" to ${file}`;
}

function table(rows: Array<Record<string, unknown>>): string {
  if (rows.length === 0) return '(none)';
  const columns = Object.keys(rows[0]);
  const widths = columns.map((column) => Math.max(column.length, ...rows.map((row) => String(row[column]).length)));
  const line = (values: string[]) => values.map((value, i) => value.padEnd(widths[i])).join('  ').trimEnd();
  return [line(columns), ...rows.map((row) => line(columns.map((column) => String(row[column]))))].join('\n');
}

export async function main(argv: string[]): Promise<number> {
  let parsed;
  try {
    parsed = parseArgs({
      args: argv,
      options: {
        'socket-dir': { type: 'string' },
        json: { type: 'boolean' },
        mutable: { type: 'boolean' },
        host: { type: 'boolean' },
        help: { type: 'boolean', short: 'h' },
      },
      allowPositionals: true,
    });
  } catch (error) {
    process.stderr.write(`vmmctl: ${(error as Error).message}\n${USAGE}\n`);
    return 2;
  }
  const { values, positionals } = parsed;
  if (values.help || positionals.length === 0) {
    process.stdout.write(`${USAGE}\n`);
    return values.help ? 0 : 2;
  }
  const [command, sub, ...rest] = positionals;
  let client: VmmdClient | undefined;
  try {
    client = await connect({ socketDir: values['socket-dir'] });
    const print = (rows: Array<Record<string, unknown>>) =>
      process.stdout.write(`${values.json ? JSON.stringify(rows, null, 2) : table(rows)}\n`);
    if (command === 'devices') {
      print((await client.devices.listDevices()).devices.map((d) => ({ index: d.index, name: d.name, uuid: d.uuid, total: d.totalBytes, free: d.freeBytes, granularity: d.granularityMinimum })));
    } else if (command === 'stats') {
      print([{ ...(await client.admin.getStats()) }]);
    } else if (command === 'sessions') {
      print((await client.admin.listSessions()).sessions.map((s) => ({ ...s })));
    } else if (command === 'objects') {
      print((await client.admin.listObjects({ ownerSession: sub ?? '0' })).objects.map((o) => ({ ...o, address: o.address === '0' ? '' : `0x${BigInt(o.address).toString(16)}` })));
    } else if (command === 'report') {
      process.stdout.write(`${JSON.stringify(await client.admin.getReport(), null, 2)}\n`);
    } else if (command === 'clear-caches') {
      const cleared = await client.admin.clearCaches();
      process.stdout.write(values.json ? `${JSON.stringify(cleared)}\n` : `closed ${cleared.transfersClosed} unclaimed descriptor(s)\n`);
    } else if (command === 'version') {
      print([{ ...(await client.admin.getVersion()) }]);
    } else if (command === 'store' && sub === 'load' && rest.length === 2) {
      process.stdout.write(`${await load(client, rest[0], rest[1], { mutable: values.mutable ?? false, host: values.host ?? false })}\n`);
    } else if (command === 'store' && sub === 'dump' && rest.length === 2) {
      process.stdout.write(`${await dump(client, rest[0], rest[1])}\n`);
    } else if (command === 'store' && sub === 'ls') {
      print(
        (await client.stores.list()).map((s) => ({
          id: s.id,
          name: s.name,
          target: s.target.replace('STORE_TARGET_', '').toLowerCase(),
          device: s.device,
          size: s.size,
          readOnly: s.readOnly,
          state: s.state.replace('STORE_STATE_', '').toLowerCase(),
          opens: s.opens,
          owner: s.ownerSession === '0' ? 'daemon' : `session ${s.ownerSession}`,
        })),
      );
    } else if (command === 'store' && sub === 'rm' && rest.length === 1) {
      const store = await client.stores.detach(rest[0]);
      process.stdout.write(`detached store ${store.id} "${store.name}"${store.opens > 0 ? `: freed when its ${store.opens} open(s) close` : ''}\n`);
    } else {
      process.stderr.write(`vmmctl: unknown command "${positionals.join(' ')}"\n${USAGE}\n`);
      return 2;
    }
    return 0;
  } catch (error) {
    const failure = VmmdError.from(error);
    process.stderr.write(`vmmctl: ${failure.code}: ${failure.message}\n`);
    return failure.errorCode;
  } finally {
    client?.close();
  }
}

if (require.main === module) {
  main(process.argv.slice(2)).then((code) => process.exit(code));
}
