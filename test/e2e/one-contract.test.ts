/**
 * One contract, two transports: allocate, release, share, export and open
 * over gRPC and over the session socket decode into the same generated
 * messages, run the same service methods and answer alike. What differs is
 * said once: on the socket the descriptor rides the answer, so its
 * transfer_id is 0 where the RPC names a transfer. Refusals are the same
 * code, status and message on both.
 */
import * as grpc from '@grpc/grpc-js';
import { connect, VmmdClient } from '../../client';
import { unaryCall } from '../../client/rpc';
import { addon } from '../../native';
import { MiB, stopWhenClean, TestDaemon } from './harness';

let daemon: TestDaemon;
let client: VmmdClient;

/** An RPC of the client's own service, with its session's token. */
function rpc<T>(api: unknown, method: string, request: object): Promise<T> {
  const { client: stub, settings } = api as { client: grpc.Client & Record<string, never>; settings: never };
  return unaryCall<object, T>(stub, stub[method], request, settings);
}

/** The descriptor an RPC's answer names, claimed and closed; its transfer id. */
async function claim(transferId: string): Promise<string> {
  addon.close(await client.session.takeTransfer(transferId));
  return transferId;
}

beforeAll(async () => {
  daemon = await TestDaemon.start();
  client = await connect({ socketDir: daemon.dir });
});

afterAll(async () => {
  await stopWhenClean(daemon, [client]);
});

describe('the session socket and gRPC', () => {
  it('answer allocate with the same ExportResponse but for the allocation id and where the descriptor travels', async () => {
    const socket = await client.session.allocate(2n * MiB);
    addon.close(socket.fd);
    const viaRpc = await rpc<{ transferId: string; allocationId: string }>(client.vmm, 'Allocate', { size: String(2n * MiB) });
    expect(await claim(viaRpc.transferId)).not.toBe('0');
    expect({ ...socket.message, allocationId: 'the new one', transferId: 'where the descriptor goes' }).toEqual({
      ...viaRpc,
      allocationId: 'the new one',
      transferId: 'where the descriptor goes',
    });
    expect(socket.message.transferId).toBe('0');
    // Release: the same ReleaseResponse for each.
    const released = await client.session.release(socket.message.allocationId);
    expect(await rpc(client.vmm, 'Release', { allocationId: viaRpc.allocationId })).toEqual(released);
    expect(released).toEqual({ freed: true, handleReferences: 0, mappingCount: 0 });
  });

  it('answer share and export of one allocation alike', async () => {
    const made = await client.vmm.create({ size: 2n * MiB });
    const key = await client.session.share(made.id);
    expect(await rpc(client.vmm, 'Share', { allocationId: made.id })).toEqual({ shareKey: key });
    const socket = await client.session.export(made.id);
    addon.close(socket.fd);
    const viaRpc = await rpc<{ transferId: string }>(client.vmm, 'Export', { allocationId: made.id, handleType: 'HANDLE_TYPE_POSIX_FD' });
    await claim(viaRpc.transferId);
    expect({ ...socket.message, transferId: '' }).toEqual({ ...viaRpc, transferId: '' });
    await client.session.release(made.id);
  });

  it('answer open of one store alike, each counted as an open', async () => {
    const made = await client.vmm.create({ size: 2n * MiB });
    const store = await client.stores.createStore({ allocationId: made.id, name: 'one-contract', readOnly: true });
    const socket = await client.session.open({ name: 'one-contract' }, false);
    addon.close(socket.fd);
    const viaRpc = await rpc<{ transferId: string; store: { opens: number } }>(client.stores, 'Open', { store: { name: 'one-contract' } });
    await claim(viaRpc.transferId);
    expect(viaRpc.store.opens).toBe(socket.message.store!.opens + 1);
    expect({ ...socket.message, transferId: '', store: { ...socket.message.store, opens: 0 } }).toEqual({
      ...viaRpc,
      transferId: '',
      store: { ...viaRpc.store, opens: 0 },
    });
    expect(socket.message.store).toMatchObject({ id: store.id, readOnly: true });
    await client.stores.detach('one-contract');
    await client.session.release(made.id);
  });

  it.each([
    ['allocate of an unaligned size', () => client.session.allocate(MiB), () => rpc(client.vmm, 'Allocate', { size: String(MiB) })],
    ['release of an allocation nobody made', () => client.session.release('424242'), () => rpc(client.vmm, 'Release', { allocationId: '424242' })],
    ['share of an allocation nobody made', () => client.session.share('424242'), () => rpc(client.vmm, 'Share', { allocationId: '424242' })],
    ['export of an allocation nobody made', () => client.session.export('424242'), () => rpc(client.vmm, 'Export', { allocationId: '424242' })],
    [
      'open of a store nobody made',
      () => client.session.open({ name: 'nothing-by-this-name' }, false),
      () => rpc(client.stores, 'Open', { store: { name: 'nothing-by-this-name' } }),
    ],
  ])('refuse %s with the same code, status and message', async (_what, socket, viaRpc) => {
    const refusal = (error: { code?: unknown; status?: number; message?: string; details?: string; metadata?: grpc.Metadata }) => ({
      code: error.metadata === undefined ? error.code : error.metadata.get('vmmd-error-code')[0],
      status: error.metadata === undefined ? error.status : error.code,
      message: error.details ?? error.message,
    });
    const fromSocket = refusal(
      await socket().then(
        () => ({}),
        (error) => error,
      ),
    );
    const fromRpc = refusal(
      await viaRpc().then(
        () => ({}),
        (error) => error,
      ),
    );
    expect(fromSocket.code).toEqual(expect.any(String));
    expect(fromSocket).toEqual(fromRpc);
  });
});
