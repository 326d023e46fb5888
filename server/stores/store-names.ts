/**
 * The names of stores not detached, indexed: CreateStore's and Attach's
 * check and every open by name are one Map lookup, however many stores there
 * are (a scan made each create cost in proportion to every uid's stores). A
 * name is claimed before the store's memory is mapped (an await): two creates
 * of one name cannot both pass the check.
 */
import { alreadyExists, invalidArgument } from '../errors';

/** The longest store name. */
export const MAX_STORE_NAME = 255;

export class StoreNames<T> {
  // Invariant: every name of a store not detached, to that store; a claimed name whose create is under way, to null. '' never.
  private readonly byName = new Map<string, T | null>();

  /**
   * Claims `name` for a store being made; '' (anonymous) claims nothing.
   * @returns what gives the claim up (the create failed); after bind() it does nothing
   * @throws INVALID_ARGUMENT BAD_NAME; ALREADY_EXISTS NAME_TAKEN
   */
  claim(name: string): () => void {
    if (name.length > MAX_STORE_NAME) throw invalidArgument('BAD_NAME', `a store name has at most ${MAX_STORE_NAME} characters, not ${name.length}`);
    if (name === '') return () => undefined;
    if (this.byName.has(name)) throw alreadyExists('NAME_TAKEN', `a store named ${JSON.stringify(name)} exists; detach it first`);
    this.byName.set(name, null);
    return () => {
      if (this.byName.get(name) === null) this.byName.delete(name);
    };
  }

  /** The store made under a claimed name. */
  bind(name: string, store: T): void {
    if (name !== '') this.byName.set(name, store);
  }

  /** The store not detached named `name`, if any ('' names none). */
  get(name: string): T | undefined {
    return this.byName.get(name) ?? undefined;
  }

  /** The store is detached: its name is free. */
  drop(name: string, store: T): void {
    if (this.byName.get(name) === store) this.byName.delete(name);
  }

  /** Names taken (tests, metrics). */
  get size(): number {
    return this.byName.size;
  }
}
