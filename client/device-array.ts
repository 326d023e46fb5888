/**
 * Typed arrays in device memory, in the style of Futhark's generated array
 * API: made from a typed array and a shape, read back whole (values) or one
 * element at a time (index), shared by reference count (retain/free), or
 * wrapped around memory that already exists.
 */
import { status as Status } from '@grpc/grpc-js';
import { VmmdError } from './errors';
import type { MemoryPointer } from './emm/memory';

/** What an array needs of the context that made it (client/context.ts's Context). */
export interface ArrayContext {
  read(pointer: bigint, length: number): Promise<Buffer>;
  free(memory: MemoryPointer): Promise<void>;
  /** Records the error for getError() and returns it to throw. */
  noteError(operation: string, error: VmmdError): VmmdError;
}

export type TypedArray =
  Int8Array | Uint8Array | Int16Array | Uint16Array | Int32Array | Uint32Array | Float32Array | Float64Array | BigInt64Array | BigUint64Array;

export interface TypedArrayClass<T extends TypedArray> {
  new (buffer: ArrayBuffer, byteOffset?: number, length?: number): T;
  readonly BYTES_PER_ELEMENT: number;
  readonly name: string;
}

export class DeviceArray<T extends TypedArray> {
  // Invariant: references > 0 while the array may be used; the memory is freed when it reaches 0.
  private references = 1;

  /** @internal Made by Context.newArray and Context.wrapArray. */
  constructor(
    private readonly context: ArrayContext,
    readonly memory: MemoryPointer,
    readonly dtype: TypedArrayClass<T>,
    readonly shape: readonly number[],
    /** Whether free() frees the memory (false for wrapped memory). */
    readonly owned: boolean,
  ) {}

  /** Number of elements. */
  get length(): number {
    return this.shape.reduce((product, extent) => product * extent, 1);
  }

  get byteLength(): number {
    return this.length * this.dtype.BYTES_PER_ELEMENT;
  }

  get referenceCount(): number {
    return this.references;
  }

  /** All elements, copied back from the device, in row-major order. */
  async values(): Promise<T> {
    this.checkLive('values');
    if (this.byteLength === 0) return new this.dtype(new ArrayBuffer(0));
    const bytes = await this.context.read(this.memory.pointer, this.byteLength);
    const copy = new ArrayBuffer(bytes.length);
    new Uint8Array(copy).set(bytes);
    return new this.dtype(copy);
  }

  /**
   * One element, by one index per dimension.
   * @throws VmmdError OUT_OF_RANGE (errorCode PROGRAM_ERROR) for an index outside the shape
   */
  async index(...indices: number[]): Promise<T[number]> {
    this.checkLive('index');
    if (indices.length !== this.shape.length) {
      throw this.fail(new VmmdError('BAD_INDEX', Status.INVALID_ARGUMENT, `${indices.length} indices for ${this.shape.length} dimensions`));
    }
    let flat = 0;
    for (let dimension = 0; dimension < indices.length; dimension++) {
      const index = indices[dimension];
      if (!Number.isInteger(index) || index < 0 || index >= this.shape[dimension]) {
        throw this.fail(new VmmdError('BAD_INDEX', Status.OUT_OF_RANGE, `index ${index} is outside dimension ${dimension} of extent ${this.shape[dimension]}`));
      }
      flat = flat * this.shape[dimension] + index;
    }
    const size = this.dtype.BYTES_PER_ELEMENT;
    const bytes = await this.context.read(this.memory.pointer + BigInt(flat * size), size);
    const copy = new ArrayBuffer(size);
    new Uint8Array(copy).set(bytes);
    return new this.dtype(copy)[0] as T[number];
  }

  /** One more reference: the memory lives until free() was called once more. */
  retain(): this {
    this.checkLive('retain');
    this.references++;
    return this;
  }

  /**
   * Drops a reference; the last one frees the memory (unless it was wrapped).
   * @throws VmmdError FAILED_PRECONDITION ALREADY_FREED
   */
  async free(): Promise<void> {
    this.checkLive('free');
    this.references--;
    if (this.references === 0 && this.owned) await this.context.free(this.memory);
  }

  private checkLive(operation: string): void {
    if (this.references === 0) {
      throw this.fail(new VmmdError('ALREADY_FREED', Status.FAILED_PRECONDITION, `${operation} on an array whose last reference was freed`));
    }
  }

  /** Records the error for Context.getError(), as every context error is, and returns it to throw. */
  private fail(error: VmmdError): VmmdError {
    return this.context.noteError('array', error);
  }
}
