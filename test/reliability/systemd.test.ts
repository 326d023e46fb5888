/**
 * The daemon under a real systemd, with its real file-descriptor store: a
 * systemd booted as PID 1 of a new PID and mount namespace (root only; it
 * runs nothing of the host's boot) starts deploy/vmmd.service, its paths
 * adapted to this checkout. A store with bytes and a session's allocation
 * are made; the daemon is SIGKILLed (systemd's Restart= starts it again with
 * FDSTORE's descriptors in LISTEN_FDS / LISTEN_FDNAMES), then restarted with
 * `systemctl restart`: each time the store is listed with its bytes and the
 * allocation is still the resumed session's, with its bytes. Skipped, with
 * the reason, where no such systemd can be started (not root, no systemd,
 * unshare or nsenter); VMMD_SYSTEMD=required makes a failed boot a failure.
 */
import { ChildProcess, execFileSync, spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { connect } from '../../client';
import { eventually, MiB, packageRoot } from '../e2e/harness';
import { figure } from './figures';

const SYSTEMD = '/lib/systemd/systemd';
const UNIT = path.join(packageRoot(), 'deploy', 'vmmd.service');
/**
 * Where the namespace sees this checkout, bind-mounted before /tmp is made
 * private there: a checkout under /tmp (a clean clone's) would be hidden, and
 * the unit's PrivateTmp=yes hides it from the service too.
 */
const CHECKOUT = '/run/vmmd-checkout';
/**
 * What the namespace's PID 1 runs first: its own /run, the test's units, and
 * nothing of the host's boot (sysinit's systemd-tmpfiles would empty the
 * host's /tmp: /tmp and /var/tmp are made private too, and it is masked).
 */
const BOOT = `set -e
mount --make-rprivate /
mount -t proc proc /proc
mount -t tmpfs tmpfs /run
mkdir -p ${CHECKOUT}
mount --bind "$1" ${CHECKOUT}
mkdir -p /run/systemd/system /run/systemd/system.control
cp "$0"/vmmd.service "$0"/vmmd-test.target /run/systemd/system/
for unit in sysinit.target basic.target local-fs.target systemd-tmpfiles-setup.service systemd-tmpfiles-setup-dev.service systemd-tmpfiles-clean.service systemd-tmpfiles-clean.timer; do
  ln -s /dev/null /run/systemd/system.control/$unit
done
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /var/tmp
export container=vmmd-test
exec ${SYSTEMD} --system --unit=vmmd-test.target --log-target=null
`;

function onPath(program: string): boolean {
  return (process.env.PATH ?? '').split(':').some((dir) => fs.existsSync(path.join(dir, program)));
}

/** Why a systemd cannot be booted here, or undefined. */
function cannotBoot(): string | undefined {
  if (process.getuid?.() !== 0) return 'not root: a PID namespace and mounts need root';
  if (!fs.existsSync(SYSTEMD)) return `no ${SYSTEMD}`;
  for (const program of ['unshare', 'nsenter', 'mount']) if (!onPath(program)) return `no ${program} on PATH`;
  return undefined;
}

/** deploy/vmmd.service with this checkout's paths: root instead of its user, host backend, sockets in `socketDir`; its fd-store settings as they are. */
function adaptedUnit(unit: string, socketDir: string): string {
  const out: string[] = [];
  for (const line of unit.split('\n')) {
    if (/^(User|Group|After|Wants)=/.test(line)) continue;
    if (line.startsWith('ExecStart=')) {
      out.push(
        `ExecStart=/bin/sh -c 'exec ${process.execPath} ${CHECKOUT}/bin/vmmd.js --socket-dir ${socketDir} --backend host --host-capacity 256MiB --parked-grace-ms 600000'`,
      );
      continue;
    }
    out.push(line);
    // Started alone: nothing of a boot before it.
    if (line === '[Unit]') out.push('DefaultDependencies=no');
    // The daemon's log beside its sockets (the namespace runs no journald), for a failure to show.
    if (line === '[Service]') out.push(`ReadWritePaths=${socketDir}`, `StandardOutput=append:${socketDir}/daemon.log`, 'StandardError=inherit');
  }
  return out.join('\n');
}

class NamespacedSystemd {
  private constructor(
    private readonly unshare: ChildProcess,
    readonly pid: number,
  ) {}

  static async boot(units: string): Promise<NamespacedSystemd> {
    const unshare = spawn('unshare', ['--pid', '--fork', '--mount', '/bin/sh', '-c', BOOT, units, packageRoot()], { stdio: 'ignore' });
    const pid = await eventually(
      () => {
        const children = fs.readFileSync(`/proc/${unshare.pid}/task/${unshare.pid}/children`, 'utf8').trim();
        return children === '' ? undefined : Number(children.split(' ')[0]);
      },
      10_000,
      'unshare to start systemd',
    );
    const systemd = new NamespacedSystemd(unshare, pid);
    await eventually(
      () => (/^(running|degraded|starting)$/.test(systemd.systemctl('is-system-running').trim()) ? true : undefined),
      30_000,
      'systemd to answer',
    );
    return systemd;
  }

  /** systemctl inside the namespace; its output (a non-zero exit is not an error: is-active and is-system-running use it). */
  systemctl(...args: string[]): string {
    try {
      return execFileSync('nsenter', ['-t', String(this.pid), '-m', '-p', 'systemctl', ...args], {
        encoding: 'utf8',
        timeout: 120_000,
        stdio: ['ignore', 'pipe', 'ignore'],
      });
    } catch (error) {
      return String((error as { stdout?: string }).stdout ?? '');
    }
  }

  show(unit: string): Record<string, string> {
    const text = this.systemctl('show', unit, '-p', 'MainPID,NFileDescriptorStore,NRestarts,SubState,ActiveState,Result,ExecMainStatus');
    return Object.fromEntries(
      text
        .trim()
        .split('\n')
        .map((line) => [line.slice(0, line.indexOf('=')), line.slice(line.indexOf('=') + 1)]),
    );
  }

  /** PID 1 killed: the kernel kills every process of the namespace with it. */
  kill(): void {
    if (this.pid > 0) process.kill(this.pid, 'SIGKILL');
    this.unshare.kill('SIGKILL');
  }
}

const why = cannotBoot();
if (why !== undefined) console.log(`systemd test skipped: ${why}`);

describe("a real systemd's file-descriptor store", () => {
  (why === undefined ? it : it.skip)(
    'keeps the stores and allocations through SIGKILL of the daemon and systemctl restart',
    async () => {
      const units = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-systemd-'));
      // In /dev/shm: the namespace's /tmp is its own.
      const socketDir = fs.mkdtempSync('/dev/shm/vmmd-systemd-');
      fs.writeFileSync(path.join(units, 'vmmd.service'), adaptedUnit(fs.readFileSync(UNIT, 'utf8'), socketDir));
      fs.writeFileSync(path.join(units, 'vmmd-test.target'), '[Unit]\nDescription=vmmd under a real systemd\n');
      let systemd: NamespacedSystemd | undefined;
      let client: Awaited<ReturnType<typeof connect>> | undefined;
      try {
        try {
          systemd = await NamespacedSystemd.boot(units);
        } catch (error) {
          if (process.env.VMMD_SYSTEMD === 'required') throw error;
          console.log(`systemd test skipped: systemd did not boot in a PID namespace: ${(error as Error).message}`);
          return;
        }
        systemd.systemctl('start', 'vmmd.service');
        expect(systemd.show('vmmd.service')).toMatchObject({ ActiveState: 'active', SubState: 'running', NFileDescriptorStore: '1' });

        client = await connect({ socketDir });
        const storeBytes = Buffer.alloc(Number(4n * MiB), 'weights kept by systemd ');
        const loaded = await client.vmm.allocate({ size: 4n * MiB });
        await loaded.write(0, storeBytes);
        await loaded.close();
        await client.stores.createStore({ allocationId: loaded.allocationId, name: 'sd-weights', readOnly: true, handOver: true });
        await client.vmm.release({ allocationId: loaded.allocationId });
        const own = await client.vmm.allocate({ size: 2n * MiB });
        const ownBytes = Buffer.alloc(4096, 'the session keeps this ');
        await own.write(0, ownBytes);
        // The journal and the two memfds.
        expect(systemd.show('vmmd.service').NFileDescriptorStore).toBe('3');

        const check = async () => {
          const stores = await client!.stores.list();
          const opened = await client!.stores.open({ name: 'sd-weights' });
          const sum = createHash('sha256')
            .update(await opened.memory.read(0, 4n * MiB))
            .digest('hex');
          await opened.close();
          const allocations = (await client!.admin.listObjects({})).objects.filter((o) => o.kind === 'allocation');
          const ownedBy = (session: string) =>
            allocations
              .filter((o) => String(o.ownerSession) === session)
              .map((o) => String(o.id))
              .sort();
          return {
            stores: stores.map((s) => s.name),
            storeSame: sum === createHash('sha256').update(storeBytes).digest('hex'),
            owned: ownedBy(String(client!.session.id)),
            daemons: ownedBy('0'),
            ownBytesSame: (await own.read(0, 4096)).equals(ownBytes),
          };
        };
        // The store's memory is the daemon's once its maker released it (held by the store), as without a restart.
        const expected = {
          stores: ['sd-weights'],
          storeSame: true,
          owned: [String(own.allocationId)],
          daemons: [String(loaded.allocationId)],
          ownBytesSame: true,
        };
        expect(await check()).toEqual(expected);

        const before = systemd.show('vmmd.service');
        const killed = Date.now();
        systemd.systemctl('kill', '--kill-whom=main', '-s', 'SIGKILL', 'vmmd.service');
        const afterKill = await eventually(
          () => {
            const now = systemd!.show('vmmd.service');
            return now.MainPID !== before.MainPID && now.MainPID !== '0' && now.SubState === 'running' ? now : undefined;
          },
          60_000,
          'systemd to start the daemon again',
        );
        const servedMs = Date.now() - killed;
        expect(afterKill).toMatchObject({ NRestarts: '1', NFileDescriptorStore: '3' });
        expect(await check()).toEqual(expected);

        systemd.systemctl('restart', 'vmmd.service');
        const afterRestart = systemd.show('vmmd.service');
        expect(afterRestart).toMatchObject({ SubState: 'running', NFileDescriptorStore: '3' });
        expect(afterRestart.MainPID).not.toBe(afterKill.MainPID);
        expect(await check()).toEqual(expected);
        figure('a real systemd (252, PID 1 of a PID namespace): deploy/vmmd.service', {
          fd_store_descriptors: Number(afterRestart.NFileDescriptorStore),
          sigkill_restarts: Number(afterKill.NRestarts),
          sigkill_to_running_ms: servedMs,
          store_and_allocation_kept_through_sigkill_and_restart: true,
        });
      } catch (error) {
        // What the daemon said is the first thing a red run needs.
        const log = path.join(socketDir, 'daemon.log');
        const said = fs.existsSync(log) ? fs.readFileSync(log, 'utf8').split('\n').slice(-40).join('\n') : '(no daemon log)';
        (error as Error).message += `\nunit: ${JSON.stringify(systemd?.show('vmmd.service'))}\nthe daemon's log, last lines:\n${said}`;
        throw error;
      } finally {
        client?.close();
        systemd?.kill();
        fs.rmSync(units, { recursive: true, force: true });
        fs.rmSync(socketDir, { recursive: true, force: true });
      }
    },
    180_000,
  );
});
