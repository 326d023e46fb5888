/**
 * The client's side of stores: typed calls, opening (the descriptor mapped
 * here, read-only for read-only stores), watching events, and the data path.
 */
import * as grpc from '@grpc/grpc-js';
import { status as Status } from '@grpc/grpc-js';
import type { CreateStoreRequest } from '../generated/vmmd/v1/CreateStoreRequest';
import type { ListStoresRequest } from '../generated/vmmd/v1/ListStoresRequest';
import type { ListStoresResponse__Output } from '../generated/vmmd/v1/ListStoresResponse';
import type { OpenRequest } from '../generated/vmmd/v1/OpenRequest';
import type { OpenResponse__Output } from '../generated/vmmd/v1/OpenResponse';
import type { DataWriteResponse__Output } from '../generated/vmmd/v1/DataWriteResponse';
import type { DataChunk__Output } from '../generated/vmmd/v1/DataChunk';
import type { Span } from '../generated/vmmd/v1/Span';
import type { Store__Output } from '../generated/vmmd/v1/Store';
import type { StoreEvent__Output } from '../generated/vmmd/v1/StoreEvent';
import type { StoresClient } from '../generated/vmmd/v1/Stores';
import type { StoreTarget } from '../generated/vmmd/v1/StoreTarget';
import { VmmdError } from './errors';
import { CudaImportedMemory, HostImportedMemory, ImportedMemory } from './local-memory';
import { CallSettings, collectStream, Input, toWire, unaryCall, writeChunks } from './rpc';
import type { ClientSession } from './session';

/** A store name or id. */
export type StoreName = string | bigint | { id?: bigint | string; name?: string };

function ref(store: StoreName): { id: string; name: string } {
  if (typeof store === 'bigint') return { id: String(store), name: '' };
  if (typeof store === 'string') return { id: '0', name: store };
  return { id: String(store.id ?? 0), name: store.name ?? '' };
}

/** A store opened by this process: its memory mapped here. close() unmaps it and drops the open. */
export class OpenedStore implements AsyncDisposable {
  private closed = false;

  constructor(
    readonly store: Store__Output,
    readonly memory: ImportedMemory,
    private readonly api: StoresApi,
  ) {}

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    await this.memory.close();
    await this.api.close(this.store.id);
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }
}

export class StoresApi {
  constructor(
    private readonly client: StoresClient,
    private readonly settings: CallSettings,
    private readonly session: ClientSession,
    private readonly backend: string,
  ) {}

  /** A store of an allocation; handOver gives it to the daemon (it outlives this session). */
  createStore(request: Input<CreateStoreRequest>): Promise<Store__Output> {
    return unaryCall(this.client, this.client.CreateStore, request, this.settings);
  }

  /**
   * Sends a descriptor and makes a store of it (the caller keeps its fd).
   * @throws VmmdError NO_CUDA_BACKEND, UNKNOWN_DEVICE, BAD_DESCRIPTOR, NAME_TAKEN
   */
  attachDescriptor(
    fd: number,
    args: { target: StoreTarget; device: number; size: bigint; readOnly: boolean; name?: string; hasDeleter?: boolean },
  ): Promise<Store__Output> {
    const transferId = this.session.sendDescriptor(fd);
    return unaryCall(
      this.client,
      this.client.Attach,
      {
        transferId,
        target: args.target,
        device: args.device,
        size: args.size,
        readOnly: args.readOnly,
        name: args.name ?? '',
        hasDeleter: args.hasDeleter ?? false,
      },
      this.settings,
    );
  }

  /**
   * Opens a store and maps it here: read-only stores always read-only.
   * @throws VmmdError UNKNOWN_STORE, STORE_DETACHED, STORE_READ_ONLY (asked writable)
   */
  async open(store: StoreName, options: { writable?: boolean } = {}): Promise<OpenedStore> {
    let opened: Pick<OpenResponse__Output, 'mappedSize' | 'granularity' | 'descriptorReadOnly'>;
    let info: Store__Output;
    let fd: number;
    if (!this.session.closed) {
      // The session socket: the descriptor comes with the answer, one round trip.
      const answer = await this.session.open(ref(store), options.writable ?? false);
      ({ message: opened, fd } = answer);
      info = answer.message.store as Store__Output;
    } else {
      const response = await unaryCall<OpenRequest, OpenResponse__Output>(
        this.client,
        this.client.Open,
        { store: ref(store), writable: options.writable ?? false },
        this.settings,
      );
      opened = response;
      info = response.store!;
      fd = await this.session.takeTransfer(response.transferId);
    }
    const readOnly = info.readOnly || opened.descriptorReadOnly || !(options.writable ?? true);
    const size = BigInt(opened.mappedSize);
    const granularity = BigInt(opened.granularity);
    let memory: ImportedMemory;
    try {
      memory =
        info.target === 'STORE_TARGET_SYSMEM' || this.backend !== 'cuda'
          ? HostImportedMemory.map(BigInt(info.allocationId), fd, size, granularity, readOnly)
          : await CudaImportedMemory.map(BigInt(info.allocationId), { fd }, size, granularity, info.device, readOnly);
    } catch (error) {
      await this.close(info.id).catch(() => undefined);
      throw error;
    }
    return new OpenedStore(info, memory, this);
  }

  /** Drops one open of this session. */
  close(storeId: bigint | string): Promise<{ opens: number }> {
    return unaryCall(this.client, this.client.Close, { storeId: String(storeId) }, this.settings);
  }

  /** No new opens; resolves once every daemon operation on the store has ended. */
  detach(store: StoreName): Promise<Store__Output> {
    return unaryCall(this.client, this.client.Detach, { store: ref(store) }, this.settings);
  }

  async list(): Promise<Store__Output[]> {
    return (await unaryCall<ListStoresRequest, ListStoresResponse__Output>(this.client, this.client.List, {}, this.settings)).stores;
  }

  /** Store events after `since`; the call ends when `cancel()` runs or the session goes. */
  watch(since: bigint | string = 0n): { events: AsyncIterable<StoreEvent__Output>; cancel: () => void } {
    let call: ReturnType<StoresClient['Watch']>;
    try {
      call = this.client.Watch({ since: String(since) }, this.settings.metadata());
    } catch (error) {
      // A closed client: the events fail, as a failed stream's would; nothing to cancel.
      return {
        events: (async function* (): AsyncGenerator<StoreEvent__Output> {
          throw VmmdError.from(error);
        })(),
        cancel: () => {},
      };
    }
    return {
      events: (async function* () {
        try {
          for await (const event of call as AsyncIterable<StoreEvent__Output>) yield event;
        } catch (error) {
          if ((error as grpc.ServiceError).code === Status.CANCELLED) return;
          throw VmmdError.fromServiceError(error as grpc.ServiceError);
        }
      })(),
      cancel: () => call.cancel(),
    };
  }

  /** Bytes of a store (or daemon-mapped memory); `onChunk` sees each chunk as it arrives (and may slow the stream). */
  async read(span: Input<Span>, length: bigint | number, onChunk?: (chunk: Buffer) => void | Promise<void>): Promise<Buffer> {
    const call = this.client.Read(toWire({ span, length }) as never, this.settings.metadata(), { deadline: Date.now() + this.settings.deadlineMs });
    return collectStream(call as AsyncIterable<DataChunk__Output>, onChunk);
  }

  /** Writes bytes through to a store: resolved once they are in its memory. */
  write(span: Input<Span>, data: Uint8Array, onProgress?: (written: number) => void): Promise<DataWriteResponse__Output> {
    return new Promise((resolve, reject) => {
      const call = this.client.Write(this.settings.metadata(), { deadline: Date.now() + this.settings.deadlineMs }, (error, response) =>
        error ? reject(VmmdError.fromServiceError(error)) : resolve(response!),
      );
      writeChunks(call, data, (offset, chunk) => ({ span: offset === 0 ? (toWire(span) as Span) : undefined, data: chunk }), onProgress);
    });
  }

  fill(span: Input<Span>, length: bigint | number, value: number): Promise<DataWriteResponse__Output> {
    return unaryCall(this.client, this.client.Fill, { span: toWire(span) as Span, length: BigInt(length), value }, this.settings);
  }

  copy(source: Input<Span>, target: Input<Span>, length: bigint | number): Promise<DataWriteResponse__Output> {
    return unaryCall(this.client, this.client.Copy, { source: toWire(source) as Span, target: toWire(target) as Span, length: BigInt(length) }, this.settings);
  }
}
