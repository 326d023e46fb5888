/**
 * Daemon crash: SIGKILL the daemon while clients hold mapped memory. Every
 * client's memory stays intact (checksums through its own mapping), the
 * client library reports the loss clearly (a 'session-lost' event with a
 * VmmdError saying what is gone and what is not; calls fail UNAVAILABLE),
 * and reconnect() opens a new session with a restarted daemon on the same
 * directory. Reports its figures.
 */
import * as grpc from '@grpc/grpc-js';
import { createHash } from 'node:crypto';
import { connect, ImportedMemory, VmmdClient, VmmdError } from '../../client';
import { MiB, TestDaemon } from '../e2e/harness';
import { figure } from './figures';

const CLIENTS = 4;

/** The scenario, on either backend (test/gpu/daemon-crash-cuda.test.ts runs it on cuda). */
export async function daemonCrashScenario(backend: 'host' | 'cuda'): Promise<void> {
  const first = await TestDaemon.start([], backend);
  const clients: VmmdClient[] = [];
  const memories: ImportedMemory[] = [];
  const sums: string[] = [];
  const lost: VmmdError[] = [];
  let second: TestDaemon | undefined;
  const checksum = async (memory: ImportedMemory) =>
    createHash('sha256')
      .update(await memory.read(0, memory.size))
      .digest('hex');
  try {
    for (let i = 0; i < CLIENTS; i++) {
      const client = await connect({ socketDir: first.dir });
      client.on('session-lost', (error: VmmdError) => lost.push(error));
      clients.push(client);
      // Memory of its own (allocate) and memory another client shared with it (import with a key).
      const memory = await client.vmm.allocate({ size: 4n * MiB });
      const bytes = Buffer.alloc(Number(memory.size));
      for (let j = 0; j < bytes.length; j += 512) bytes[j] = (i * 31 + j) & 0xff;
      await memory.write(0, bytes);
      memories.push(memory);
    }
    const { shareKey } = await clients[0].vmm.share({ allocationId: memories[0].allocationId });
    const sharedView = await clients[1].vmm.import(memories[0].allocationId, { shareKey });
    memories.push(sharedView);
    for (const memory of memories) sums.push(await checksum(memory));

    first.process.kill('SIGKILL');
    await new Promise((resolve) => first.process.once('exit', resolve));
    const deadline = Date.now() + 10_000;
    while (lost.length < CLIENTS && Date.now() < deadline) await new Promise((resolve) => setTimeout(resolve, 20));
    expect(lost).toHaveLength(CLIENTS);
    for (const error of lost) {
      expect(error).toMatchObject({ code: 'SESSION_LOST', status: grpc.status.UNAVAILABLE });
      expect(error.message).toMatch(/daemon went away.*memory mapped in this process stays valid.*reconnect\(\)/);
    }
    expect(clients.every((client) => client.lost)).toBe(true);
    await expect(clients[2].devices.getGranularity()).rejects.toMatchObject({ status: grpc.status.UNAVAILABLE });
    // The memory: intact, and still writable through the mappings the clients hold.
    const intactAfterCrash = (await Promise.all(memories.map(checksum))).filter((sum, index) => sum === sums[index]).length;
    expect(intactAfterCrash).toBe(memories.length);
    await memories[0].write(0, Buffer.from('after the crash'));
    expect((await sharedView.read(0, 15)).toString()).toBe('after the crash');

    // A restarted daemon on the same directory (its stale sockets replaced), and new sessions with it.
    second = await TestDaemon.start(['--socket-dir', first.dir], backend);
    const started = Date.now();
    const reconnected = await Promise.all(clients.map((client) => client.reconnect()));
    const reconnectMs = Date.now() - started;
    for (const client of reconnected) await client.devices.getGranularity();
    const fresh = await reconnected[3].vmm.allocate({ size: 2n * MiB });
    await fresh.write(0, Buffer.from('new session'));
    expect((await fresh.read(0, 11)).toString()).toBe('new session');
    expect((await second.stats()).sessions).toBe(CLIENTS);
    for (const client of reconnected) client.close();
    figure(`daemon crash (${backend})`, {
      backend,
      clients: CLIENTS,
      mappings_held: memories.length,
      mappings_intact_after_sigkill: intactAfterCrash,
      clients_told_session_lost: lost.length,
      reconnect_ms_all_clients: reconnectMs,
    });
  } finally {
    for (const memory of memories) await memory.close().catch(() => undefined);
    for (const client of clients) client.close();
    first.raw.close();
    if (second) expect(await second.stop()).toBe(0);
  }
}
