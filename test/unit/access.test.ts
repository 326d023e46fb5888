/** The allow and admin lists match a peer's supplementary groups as well as its primary one. */
import * as fs from 'node:fs';
import { AccessPolicy, authorize, describePeer, supplementaryGroups } from '../../server/transport/grpc/access';

const lists = { allowUids: [], allowGids: [2000], adminUids: [0], adminGids: [3000] };

test('a supplementary group in the allow list admits the peer; the refusal names every group seen', () => {
  expect(authorize(lists, { pid: 1, uid: 1000, gid: 1000, groups: [27, 2000] })).toBeUndefined();
  expect(authorize(lists, { pid: 1, uid: 1000, gid: 1000, groups: [27] })).toBe('uid 1000 (gid 1000, groups 27) is not allowed: allowed uids [], gids [2000]');
  expect(authorize(lists, { pid: 1, uid: 1000, gid: 2000, groups: [] })).toBeUndefined();
});

test('a supplementary group in the admin list makes an admin', () => {
  const policy = new AccessPolicy(lists);
  expect(policy.isAdmin({ pid: 1, uid: 1000, gid: 1000, groups: [3000] })).toBe(true);
  expect(policy.isAdmin({ pid: 1, uid: 1000, gid: 1000, groups: [2000] })).toBe(false);
});

test('without SO_PEERGROUPS the groups come from /proc/PID/status', () => {
  const line = /^Groups:(.*)$/m.exec(fs.readFileSync('/proc/self/status', 'utf8'))![1].trim();
  const expected = line === '' ? [] : line.split(/\s+/).map(Number);
  expect(supplementaryGroups({ pid: process.pid, uid: 0, gid: 0 })).toEqual(expected);
  expect(describePeer({ pid: 2 ** 22 + 1, uid: 5, gid: 6 })).toBe('uid 5 (gid 6)');
});
