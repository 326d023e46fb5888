/**
 * A unary call of a resumable session that the daemon's going away cut off:
 * a call that changes nothing goes again once the session serves, whether the
 * cut reached the client as UNAVAILABLE or as CANCELLED (the stream reset by
 * a daemon that stopped with the call in flight: the client's unary calls are
 * never cancelled by the client itself); a call that is not safe to repeat
 * fails to its caller. A Detach goes again too (the end is the same however
 * often it runs); when the repeat finds the store detached or gone, the
 * cut-off one did it, and the caller is answered so.
 */
import * as grpc from '@grpc/grpc-js';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { unaryCall, type ResumableSession } from '../../client/rpc';
import { ERROR_CODE_KEY } from '../../common/protocol';

const json = { serialize: (value: unknown) => Buffer.from(JSON.stringify(value)), deserialize: (bytes: Buffer) => JSON.parse(bytes.toString()) };
const method = (name: string, service = 'Admin') => ({
  path: `/vmmd.v1.${service}/${name}`,
  requestStream: false,
  responseStream: false,
  requestSerialize: json.serialize,
  requestDeserialize: json.deserialize,
  responseSerialize: json.serialize,
  responseDeserialize: json.deserialize,
});
const SERVICE = { GetReport: method('GetReport'), Create: method('Create'), Detach: method('Detach', 'Stores') };

const session: ResumableSession = { resumeToken: 'token', closed: false, isResuming: false, ready: async () => undefined };

describe('a unary call cut off by the daemon going away', () => {
  let server: grpc.Server;
  let client: grpc.Client;
  let dir: string;
  // Each call's answer in turn: a status cuts it off; a code is the daemon's refusal (FAILED_PRECONDITION, NOT_FOUND).
  const cuts: Array<grpc.status | string> = [];
  const seen: Record<string, number> = {};

  beforeAll(async () => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-rpc-again-'));
    server = new grpc.Server();
    const answer = (name: string) => (_call: unknown, callback: grpc.sendUnaryData<unknown>) => {
      seen[name] = (seen[name] ?? 0) + 1;
      const cut = cuts.shift();
      if (typeof cut === 'number') callback({ code: cut, details: 'cut off' });
      else if (cut !== undefined) {
        const metadata = new grpc.Metadata();
        metadata.set(ERROR_CODE_KEY, cut);
        callback({ code: cut === 'STORE_DETACHED' ? grpc.status.FAILED_PRECONDITION : grpc.status.NOT_FOUND, details: cut, metadata });
      } else callback(null, { answered: name });
    };
    server.addService(SERVICE, { GetReport: answer('GetReport'), Create: answer('Create'), Detach: answer('Detach') });
    await new Promise<void>((resolve, reject) =>
      server.bindAsync(`unix:${dir}/s.sock`, grpc.ServerCredentials.createInsecure(), (error) => (error ? reject(error) : resolve())),
    );
    const Client = grpc.makeGenericClientConstructor(SERVICE, 'Admin');
    client = new Client(`unix:${dir}/s.sock`, grpc.credentials.createInsecure());
  });

  afterAll(() => {
    client.close();
    server.forceShutdown();
    fs.rmSync(dir, { recursive: true, force: true });
  });

  beforeEach(() => {
    cuts.length = 0;
    for (const key of Object.keys(seen)) delete seen[key];
  });

  const call = (name: 'GetReport' | 'Create' | 'Detach', request: object = {}) =>
    unaryCall(client, (client as unknown as Record<string, never>)[name], request, { metadata: () => new grpc.Metadata(), deadlineMs: 5_000, session });

  it.each([grpc.status.UNAVAILABLE, grpc.status.CANCELLED])('a call that changes nothing goes again after status %i', async (status) => {
    cuts.push(status);
    await expect(call('GetReport')).resolves.toEqual({ answered: 'GetReport' });
    expect(seen.GetReport).toBe(2);
  });

  it('a call that is not safe to repeat fails to its caller, sent once', async () => {
    cuts.push(grpc.status.CANCELLED);
    await expect(call('Create')).rejects.toMatchObject({ status: grpc.status.CANCELLED });
    expect(seen.Create).toBe(1);
  });

  it.each([grpc.status.UNAVAILABLE, grpc.status.CANCELLED])('a Detach cut off (status %i) goes again', async (status) => {
    cuts.push(status);
    await expect(call('Detach', { store: { id: '0', name: 'weights' } })).resolves.toEqual({ answered: 'Detach' });
    expect(seen.Detach).toBe(2);
  });

  it.each(['UNKNOWN_STORE', 'STORE_DETACHED'])('a Detach whose repeat is refused %s was done by the one cut off: answered detached', async (code) => {
    cuts.push(grpc.status.UNAVAILABLE, code);
    await expect(call('Detach', { store: { id: '7', name: 'weights' } })).resolves.toMatchObject({
      id: '7',
      name: 'weights',
      state: 'STORE_STATE_DETACHED',
    });
    expect(seen.Detach).toBe(2);
  });

  it('a Detach refused at its first sending fails to its caller: nothing says it was done', async () => {
    cuts.push('UNKNOWN_STORE');
    await expect(call('Detach', { store: { id: '0', name: 'weights' } })).rejects.toMatchObject({ code: 'UNKNOWN_STORE' });
    expect(seen.Detach).toBe(1);
  });
});
