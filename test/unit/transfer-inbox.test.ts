/** The transfer inbox both ends of the session socket share. */
import { TransferInbox } from '../../common/transfer-inbox';

function inbox(options: { increasing?: boolean; maxHeld?: number; keepMs?: number } = {}) {
  const closed: number[] = [];
  const expired: string[] = [];
  const box = new TransferInbox({
    keepMs: options.keepMs ?? 10_000,
    maxHeld: options.maxHeld,
    increasing: options.increasing ?? true,
    close: (fd) => closed.push(fd),
    expired: (transfer) => expired.push(transfer),
    errors: {
      notReceived: (transfer, ms) => Object.assign(new Error(`${transfer} not within ${ms}`), { code: 'TRANSFER_NOT_RECEIVED' }),
      used: (transfer, when) => Object.assign(new Error(`${transfer} ${when}`), { code: 'TRANSFER_USED' }),
      closed: (transfer) => Object.assign(new Error(`closed ${transfer ?? ''}`), { code: 'SESSION_CLOSED' }),
    },
  });
  return { box, closed, expired };
}

describe('transfer inbox', () => {
  it('pairs a descriptor with its claim, whichever comes first', async () => {
    const { box } = inbox();
    expect(box.deliver('1', 11)).toEqual({ kind: 'held' });
    expect(box.held).toBe(1);
    await expect(box.take('1', 100)).resolves.toBe(11);
    const waiting = box.take('2', 1000);
    expect(box.deliver('2', 12)).toEqual({ kind: 'claimed' });
    await expect(waiting).resolves.toBe(12);
    expect(box.held).toBe(0);
  });

  it('with increasing ids, refuses a replayed id (closing its descriptor) and a claim of a used one', async () => {
    const { box, closed } = inbox();
    box.deliver('7', 70);
    expect(box.deliver('7', 71)).toMatchObject({ kind: 'refused', code: 'TRANSFER_USED' });
    expect(box.deliver('3', 30)).toMatchObject({ kind: 'refused', code: 'TRANSFER_USED' });
    expect(closed).toEqual([71, 30]);
    await box.take('7', 100);
    await expect(box.take('7', 100)).rejects.toMatchObject({ code: 'TRANSFER_USED', message: '7 past' });
    const first = box.take('9', 1000);
    await expect(box.take('9', 100)).rejects.toMatchObject({ code: 'TRANSFER_USED', message: '9 claiming' });
    box.deliver('9', 90);
    await expect(first).resolves.toBe(90);
  });

  it('refuses a descriptor beyond the bound and closes it', () => {
    const { box, closed } = inbox({ maxHeld: 1 });
    box.deliver('1', 10);
    expect(box.deliver('2', 20)).toMatchObject({ kind: 'refused', code: 'TOO_MANY_TRANSFERS' });
    expect(closed).toEqual([20]);
    expect(box.held).toBe(1);
  });

  it('times a claim out, and expires an unclaimed descriptor (closing it)', async () => {
    const { box, closed, expired } = inbox({ keepMs: 20 });
    await expect(box.take('1', 10)).rejects.toMatchObject({ code: 'TRANSFER_NOT_RECEIVED', message: '1 not within 10' });
    box.deliver('2', 20);
    await new Promise((resolve) => setTimeout(resolve, 60));
    expect(closed).toEqual([20]);
    expect(expired).toEqual(['2']);
    expect(box.held).toBe(0);
  });

  it('on close fails every waiting claim, closes every held descriptor, and refuses later claims', async () => {
    const { box, closed } = inbox();
    const waiting = box.take('5', 10_000);
    box.deliver('4', 40);
    box.close();
    await expect(waiting).rejects.toMatchObject({ code: 'SESSION_CLOSED', message: 'closed 5' });
    expect(closed).toEqual([40]);
    await expect(box.take('6', 10)).rejects.toMatchObject({ code: 'SESSION_CLOSED' });
  });

  it('without increasing ids (the client), a newer descriptor for an id replaces the older, which is closed', async () => {
    const { box, closed } = inbox({ increasing: false });
    box.deliver('1', 10);
    box.deliver('1', 11);
    expect(closed).toEqual([10]);
    await expect(box.take('1', 10)).resolves.toBe(11);
  });
});
