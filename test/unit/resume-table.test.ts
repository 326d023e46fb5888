/** Parked sessions waiting for their clients: who may resume one, and what a late or wrong client hears. */
import { newResumeToken, ParkedSession, ResumeTable } from '../../server/transport/session/resume';

const parked = (id: bigint, uid = 1000): ParkedSession => ({ id, uid, gid: uid, token: newResumeToken(), resumeToken: newResumeToken() });
const fresh = (uid = 1000, used = false) => ({ id: 99n, peer: { uid }, used, resumed: false });
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

test('a waiting session is claimed once, by its uid, with its resume token', () => {
  const table = new ResumeTable();
  const session = parked(5n);
  table.wait([session], 60_000, () => undefined);
  expect(table.byGrpcToken(session.token)).toBe(session);
  expect(table.claim(session.resumeToken, fresh())).toBe(session);
  expect(table.count).toBe(0);
  expect(table.byGrpcToken(session.token)).toBeUndefined();
  expect(() => table.claim(session.resumeToken, fresh())).toThrow(expect.objectContaining({ code: 'RESUME_UNKNOWN' }));
});

test('a refused claim changes nothing: another uid, a used connection, a malformed or unknown token', () => {
  const table = new ResumeTable();
  const session = parked(6n);
  table.wait([session], 60_000, () => undefined);
  expect(() => table.claim(session.resumeToken, fresh(1001))).toThrow(
    expect.objectContaining({ code: 'RESUME_OF_ANOTHER_UID', message: 'uid 1001 may not resume a session of another uid' }),
  );
  expect(() => table.claim(session.resumeToken, fresh(1000, true))).toThrow(expect.objectContaining({ code: 'RESUME_DUPLICATE' }));
  expect(() => table.claim('ABC', fresh())).toThrow(
    expect.objectContaining({ code: 'BAD_MESSAGE', message: 'hello: resumeToken "ABC" is not 64 lowercase hex digits' }),
  );
  expect(() => table.claim(42, fresh())).toThrow(expect.objectContaining({ code: 'BAD_MESSAGE' }));
  expect(() => table.claim(newResumeToken(), fresh())).toThrow(expect.objectContaining({ code: 'RESUME_UNKNOWN' }));
  expect(table.count).toBe(1);
  expect(table.claim(session.resumeToken, fresh())).toBe(session);
});

test('a session not claimed within the grace is expired once; its late client hears SESSION_RECLAIMED', async () => {
  const table = new ResumeTable();
  const late = parked(7n);
  const expired: bigint[] = [];
  table.wait([late], 20, (session) => expired.push(session.id));
  await sleep(80);
  expect(expired).toEqual([7n]);
  expect(table.get(7n)).toBeUndefined();
  expect(() => table.claim(late.resumeToken, fresh())).toThrow(
    expect.objectContaining({ code: 'SESSION_RECLAIMED', message: expect.stringMatching(/^session 7 was not resumed within the grace period/) }),
  );
});

test('records that repeat a waiting session are refused whole', () => {
  const table = new ResumeTable();
  const first = parked(8n);
  table.wait([first], 60_000, () => undefined);
  expect(() => table.wait([parked(9n), { ...parked(8n) }], 60_000, () => undefined)).toThrow(expect.objectContaining({ code: 'RESUME_DUPLICATE' }));
  expect(table.list().map((session) => session.id)).toEqual([8n]);
  expect(table.drain()).toEqual([first]);
  expect(table.count).toBe(0);
});
