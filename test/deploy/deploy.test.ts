/**
 * The deployment files, checked for what they must hold and started as they
 * start the daemon. Docker is not available on these machines (no engine, no
 * image build): the Dockerfile is parsed, and its ENTRYPOINT, USER and
 * HEALTHCHECK are run here as the image would run them, from the repository
 * (the image's /app holds the same bin/, dist/, build/ and node_modules/).
 * The DaemonSet's container is started with its own args appended to that
 * ENTRYPOINT, as its user and group, with every capability dropped
 * (setpriv --bounding-set=-all), and must answer the gRPC health check that
 * its probes make. Substituted, and only these: the hostPath directory (a
 * temporary one), the ports (free ones: tests run in parallel) and, where
 * there is no GPU, --backend cuda by host.
 */
import { ChildProcess, execFileSync, spawn, spawnSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { freePort, healthCheck, scrapeMetrics } from '../e2e/harness';

const yaml = require('js-yaml') as { loadAll(text: string): any[] };

const ROOT = path.resolve(__dirname, '../..');
const has = (tool: string) => spawnSync('sh', ['-c', `command -v ${tool}`]).status === 0;
const GPU = fs.existsSync('/dev/nvidiactl');

interface Dockerfile {
  /** Instructions of the last stage, the image that runs. */
  final: Array<{ instruction: string; args: string }>;
  entrypoint: string[];
  user: string;
  workdir: string;
  healthcheck: string[];
}

function parseDockerfile(text: string): Dockerfile {
  const lines = text
    .replace(/\\\n/g, ' ')
    .split('\n')
    .filter((line) => line.trim() !== '' && !line.trimStart().startsWith('#'));
  const stages: Array<Array<{ instruction: string; args: string }>> = [];
  for (const line of lines) {
    const [, instruction, args] = /^\s*([A-Z]+)\s+(.*)$/.exec(line) ?? [];
    if (instruction === undefined) throw new Error(`Dockerfile: cannot read "${line}"`);
    if (instruction === 'FROM') stages.push([]);
    stages[stages.length - 1].push({ instruction, args: args.trim() });
  }
  const final = stages[stages.length - 1];
  const last = (name: string) => [...final].reverse().find((entry) => entry.instruction === name)?.args;
  const healthcheck = /CMD\s+(\[.*\])$/.exec(last('HEALTHCHECK') ?? '')?.[1];
  return {
    final,
    entrypoint: JSON.parse(last('ENTRYPOINT') ?? '[]'),
    user: last('USER') ?? '',
    workdir: last('WORKDIR') ?? '/',
    healthcheck: healthcheck === undefined ? [] : JSON.parse(healthcheck),
  };
}

const dockerfile = parseDockerfile(fs.readFileSync(path.join(ROOT, 'Dockerfile'), 'utf8'));
const manifests = yaml.loadAll(fs.readFileSync(path.join(ROOT, 'deploy', 'k8s', 'daemonset.yaml'), 'utf8'));
const daemonSet = manifests.find((doc) => doc.kind === 'DaemonSet');
const podSpec = daemonSet.spec.template.spec;
const container = podSpec.containers.find((c: any) => c.name === 'vmmd');
const initContainer = podSpec.initContainers?.[0];
/** The container's command line as the runtime builds it: the image's ENTRYPOINT, then args. */
const containerCommand: string[] = [...dockerfile.entrypoint, ...container.args];

/** The value after `flag` in a command line, or undefined. */
function flag(command: string[], name: string): string | undefined {
  const at = command.lastIndexOf(name);
  return at < 0 ? undefined : command[at + 1];
}

describe('systemd unit', () => {
  const unitFile = path.join(ROOT, 'deploy', 'vmmd.service');
  const unit = fs.readFileSync(unitFile, 'utf8');
  /** key → values of the [Service] section. */
  const service = new Map<string, string[]>();
  let section = '';
  for (const line of unit.split('\n')) {
    const header = /^\[(\w+)\]$/.exec(line.trim());
    if (header) section = header[1];
    const entry = /^(\w+)=(.*)$/.exec(line);
    if (entry && section === 'Service') service.set(entry[1], [...(service.get(entry[1]) ?? []), entry[2]]);
  }

  test('systemd-analyze verify accepts it (where systemd-analyze exists)', () => {
    if (!has('systemd-analyze')) {
      console.warn('systemd-analyze is not installed here: the unit was only parsed');
      return;
    }
    const verified = spawnSync('systemd-analyze', ['verify', unitFile], { encoding: 'utf8' });
    expect({ status: verified.status, stderr: verified.stderr }).toEqual({ status: 0, stderr: '' });
  });

  test('runs as its own user, with no capabilities, notifying readiness', () => {
    expect(service.get('User')).toEqual(['vmmd']);
    expect(service.get('Group')).toEqual(['vmmd']);
    expect(service.get('Type')).toEqual(['notify']);
    expect(service.get('CapabilityBoundingSet')).toEqual(['']);
    expect(service.get('NoNewPrivileges')).toEqual(['yes']);
    expect(service.get('RuntimeDirectory')).toEqual(['vmmd']);
    const exec = service.get('ExecStart')![0];
    expect(exec).toContain('/opt/vmmd/bin/vmmd.js --socket-dir /run/vmmd');
    // The socket group is the service's own group: giving it needs no capability.
    expect(exec).toContain('--socket-group "$(id -g)"');
  });

  test("serves GPU memory or fails: --backend cuda, never auto's silent fall back to host memory", () => {
    expect(service.get('ExecStart')![0]).toMatch(/--backend cuda\b/);
  });

  test('allows the NVIDIA devices by their device groups, not by paths that may not exist yet at start', () => {
    expect(service.get('DevicePolicy')).toEqual(['closed']);
    expect(service.get('DeviceAllow')).toEqual(['char-nvidia-frontend rw', 'char-nvidia-uvm rw', 'char-nvidia-caps rw']);
  });
});

describe('Dockerfile (Docker is not available here: parsed, and its commands run as the image runs them)', () => {
  test('the running image has a dedicated non-root user that owns the socket directory', () => {
    expect(dockerfile.user).toBe('10001:2000');
    const run = dockerfile.final
      .filter((entry) => entry.instruction === 'RUN')
      .map((entry) => entry.args)
      .join(' ');
    expect(run).toMatch(/groupadd --system --gid 2000 vmmd/);
    expect(run).toMatch(/useradd --system --uid 10001 --gid 2000 .*vmmd/);
    expect(run).toMatch(/install -d -o 10001 -g 2000 -m 0750 \/run\/vmmd/);
    expect(dockerfile.entrypoint.slice(0, 2)).toEqual(['node', 'bin/vmmd.js']);
    // Its socket group is the user's own group.
    expect(flag(dockerfile.entrypoint, '--socket-group')).toBe(dockerfile.user.split(':')[1]);
    // A docker client may be installed; the engine is not: if this fails, Docker came, and this test should build the image.
    expect(spawnSync('docker', ['info'], { timeout: 10_000 }).status === 0).toBe(false);
  });
});

describe('Kubernetes manifests', () => {
  test('capabilities match what the flags need', () => {
    const security = { ...podSpec.securityContext, ...container.securityContext };
    expect(security.runAsNonRoot).toBe(true);
    expect(security.runAsUser).toBeGreaterThan(0);
    expect(security.allowPrivilegeEscalation).toBe(false);
    expect(security.capabilities.drop).toEqual(['ALL']);
    const added: string[] = security.capabilities.add ?? [];
    // --socket-group G: chown to G needs CAP_CHOWN unless G is one of the process's own groups.
    const group = flag(containerCommand, '--socket-group');
    if (group !== undefined) {
      const own = [security.runAsGroup, ...(podSpec.securityContext.supplementalGroups ?? [])].map(String);
      expect(own.includes(group) || added.includes('CHOWN')).toBe(true);
    }
    // Ports below 1024 need CAP_NET_BIND_SERVICE.
    for (const name of ['--metrics-port', '--health-port']) {
      const port = Number(flag(containerCommand, name) ?? 0);
      if (port > 0 && port < 1024) expect(added).toContain('NET_BIND_SERVICE');
    }
    // Nothing added that no flag needs.
    expect(added).toEqual([]);
  });

  test("the init container hands the hostPath to the daemon's user with CAP_CHOWN only", () => {
    expect(initContainer.securityContext.capabilities).toEqual({ drop: ['ALL'], add: ['CHOWN'] });
    expect(initContainer.command.join(' ')).toContain(`chown ${podSpec.securityContext.runAsUser}:${podSpec.securityContext.runAsGroup} /run/vmmd`);
    expect(initContainer.volumeMounts).toEqual(container.volumeMounts);
  });

  test('tolerates the nvidia.com/gpu taint, has a priority class', () => {
    expect(podSpec.tolerations).toContainEqual({ key: 'nvidia.com/gpu', operator: 'Exists', effect: 'NoSchedule' });
    expect(podSpec.priorityClassName).toBe('system-node-critical');
  });

  test('probes are gRPC health checks on the health port, not processes', () => {
    const healthPort = Number(flag(containerCommand, '--health-port'));
    expect(healthPort).toBeGreaterThan(0);
    for (const probe of ['startupProbe', 'readinessProbe', 'livenessProbe']) {
      expect(container[probe].grpc).toEqual({ port: healthPort });
      expect(container[probe].exec).toBeUndefined();
    }
  });

  test('metrics are reachable: bound to all addresses, a named port, scrape annotations and a Service', () => {
    const port = Number(flag(containerCommand, '--metrics-port'));
    expect(flag(containerCommand, '--metrics-address')).toBe('0.0.0.0');
    expect(container.ports).toContainEqual({ name: 'metrics', containerPort: port, protocol: 'TCP' });
    const annotations = daemonSet.spec.template.metadata.annotations;
    expect(annotations).toMatchObject({ 'prometheus.io/scrape': 'true', 'prometheus.io/port': String(port), 'prometheus.io/path': '/metrics' });
    const metricsService = manifests.find((doc) => doc.kind === 'Service');
    expect(metricsService.spec.selector).toEqual(daemonSet.spec.template.metadata.labels);
    expect(metricsService.spec.ports).toContainEqual({ name: 'metrics', port, targetPort: 'metrics', protocol: 'TCP' });
    expect(metricsService.metadata.namespace).toBe(daemonSet.metadata.namespace);
  });

  test('the client example runs non-root in the socket group', () => {
    const client = manifests.find((doc) => doc.kind === 'Pod');
    expect(client.spec.securityContext.runAsNonRoot).toBe(true);
    expect(client.spec.securityContext.supplementalGroups).toContain(Number(flag(containerCommand, '--socket-group')));
  });
});

/** Runs `command` as uid:gid with no supplementary groups and no capabilities at all, as the pod does. */
function dropped(uid: number, gid: number, command: string[], env: NodeJS.ProcessEnv, cwd: string): ChildProcess {
  return spawn(
    'setpriv',
    [`--reuid=${uid}`, `--regid=${gid}`, '--clear-groups', '--inh-caps=-all', '--bounding-set=-all', '--no-new-privs', '--', ...command],
    {
      cwd,
      env,
      stdio: ['ignore', 'pipe', 'pipe'],
    },
  );
}

async function waitFor<T>(what: string, check: () => Promise<T>, child: ChildProcess, output: () => string): Promise<T> {
  const deadline = Date.now() + 20_000;
  for (;;) {
    try {
      return await check();
    } catch (error) {
      if (child.exitCode !== null) throw new Error(`the daemon exited ${child.exitCode} before ${what}:\n${output()}`);
      if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}: ${(error as Error).message}\n${output()}`);
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
  }
}

const describeAsRoot = process.getuid?.() === 0 && has('setpriv') ? describe : describe.skip;
if (!(process.getuid?.() === 0 && has('setpriv'))) console.warn('not root or no setpriv: the DaemonSet start is skipped');

describeAsRoot('the daemon started exactly as the DaemonSet starts it', () => {
  let hostPath: string;
  let child: ChildProcess | undefined;
  let output = '';

  beforeEach(() => {
    hostPath = fs.mkdtempSync(path.join(os.tmpdir(), 'vmmd-hostpath-'));
    // kubelet's DirectoryOrCreate makes it root-owned 0755.
    fs.chmodSync(hostPath, 0o755);
    output = '';
  });

  afterEach(async () => {
    if (child && child.exitCode === null) {
      const exited = new Promise((resolve) => child!.once('exit', resolve));
      child.kill('SIGTERM');
      await exited;
    }
    child = undefined;
    fs.rmSync(hostPath, { recursive: true, force: true });
  });

  /** The container's command line, with only the hostPath, the ports and (without a GPU) the backend replaced. */
  function asHere(command: string[], ports: Record<string, number>): string[] {
    const mount = container.volumeMounts.find((m: any) => m.name === 'sockets').mountPath;
    return command.map((arg, i) => {
      if (arg === mount) return hostPath;
      if (command[i - 1] !== undefined && command[i - 1] in ports) return String(ports[command[i - 1]]);
      if (command[i - 1] === '--backend' && arg === 'cuda' && !GPU) return 'host';
      return arg;
    });
  }

  function environment(): NodeJS.ProcessEnv {
    return {
      PATH: process.env.PATH,
      ...Object.fromEntries(container.env.map((e: { name: string; value: string }) => [e.name, e.value])),
      NODE_ENV: 'production',
    };
  }

  /** The init container's command on the hostPath, as the runtime runs it: root with CAP_CHOWN only, no privilege escalation. */
  function runInit(): { status: number | null; stderr: string } {
    const added = initContainer.securityContext.capabilities.add.map((cap: string) => `+${cap.toLowerCase()}`).join(',');
    const init = spawnSync(
      'setpriv',
      [
        '--inh-caps=-all',
        '--ambient-caps=-all',
        `--bounding-set=-all,${added}`,
        '--no-new-privs',
        '--',
        ...initContainer.command.map((arg: string) => arg.replaceAll('/run/vmmd', hostPath)),
      ],
      { encoding: 'utf8' },
    );
    return { status: init.status, stderr: init.stderr };
  }

  test("the init container's command succeeds again on the directory it already handed over (a pod restarted on its node), 10 times of 10", () => {
    const results = [];
    for (let i = 0; i < 10; i++) {
      fs.rmSync(hostPath, { recursive: true, force: true });
      fs.mkdirSync(hostPath, { mode: 0o755 });
      fs.chmodSync(hostPath, 0o755);
      results.push(runInit(), runInit());
    }
    expect(results).toEqual(Array.from({ length: 20 }, () => ({ status: 0, stderr: '' })));
    const dir = fs.statSync(hostPath);
    expect({ uid: dir.uid, gid: dir.gid, mode: (dir.mode & 0o777).toString(8) }).toEqual({ uid: 10001, gid: 2000, mode: '750' });
  });

  test("the init container repairs a directory the daemon's user owns with a wrong mode and group", () => {
    fs.chownSync(hostPath, 10001, 10001);
    fs.chmodSync(hostPath, 0o777);
    expect(runInit()).toEqual({ status: 0, stderr: '' });
    const dir = fs.statSync(hostPath);
    expect({ uid: dir.uid, gid: dir.gid, mode: (dir.mode & 0o777).toString(8) }).toEqual({ uid: 10001, gid: 2000, mode: '750' });
  });

  /** One pod start on this node: the init container, then the daemon until its health probe says SERVING. */
  async function startPod(ports: Record<string, number>): Promise<ChildProcess> {
    expect(runInit()).toEqual({ status: 0, stderr: '' });
    const { runAsUser: uid, runAsGroup: gid } = podSpec.securityContext;
    const started = dropped(uid, gid, asHere(containerCommand, ports), environment(), ROOT);
    started.stdout!.on('data', (chunk) => (output += chunk));
    started.stderr!.on('data', (chunk) => (output += chunk));
    expect(
      await waitFor(
        'health SERVING',
        () => healthCheck(ports['--health-port']),
        started,
        () => output,
      ),
    ).toBe('SERVING');
    return started;
  }

  test('the pod restarted 10 times on one node: 10 starts, each SERVING and stopped with 0', async () => {
    const ports = { '--metrics-port': await freePort(), '--health-port': await freePort() };
    const codes: Array<number | null> = [];
    for (let i = 0; i < 10; i++) {
      child = await startPod(ports);
      const exited = new Promise<number | null>((resolve) => child!.once('exit', resolve));
      child.kill('SIGTERM');
      codes.push(await exited);
    }
    expect(codes).toEqual(Array.from({ length: 10 }, () => 0));
  }, 300_000);

  test('init container, then the daemon with no capabilities: health SERVING on the probe port, metrics on all addresses, sockets for the group', async () => {
    expect(runInit()).toEqual({ status: 0, stderr: '' });
    const { runAsUser: uid, runAsGroup: gid } = podSpec.securityContext;
    const ports = { '--metrics-port': await freePort(), '--health-port': await freePort() };
    const command = asHere(containerCommand, ports);
    expect(command.slice(0, 2)).toEqual(['node', 'bin/vmmd.js']);
    // The image's WORKDIR (/app) is this repository here.
    child = dropped(uid, gid, command, environment(), ROOT);
    child.stdout!.on('data', (chunk) => (output += chunk));
    child.stderr!.on('data', (chunk) => (output += chunk));
    // What the kubelet's grpc probe asks: grpc.health.v1.Health/Check with service "".
    expect(
      await waitFor(
        'health SERVING',
        () => healthCheck(ports['--health-port']),
        child,
        () => output,
      ),
    ).toBe('SERVING');
    expect(await healthCheck(ports['--health-port'], 'vmmd.v1.VirtualMemory')).toBe('SERVING');
    expect(await scrapeMetrics(ports['--metrics-port'])).toContain('vmmd_build_info');
    // The process really has no capability and is the pod's user.
    // setpriv execs the command: the child's pid is the daemon's.
    const own = fs.readFileSync(`/proc/${child.pid}/status`, 'utf8');
    expect(own).toMatch(new RegExp(`^Uid:\\s+${uid}\\s+${uid}\\s+${uid}\\s+${uid}$`, 'm'));
    expect(own).toMatch(/^CapEff:\s+0+$/m);
    expect(own).toMatch(/^CapBnd:\s+0+$/m);
    // Directory and sockets for the socket group, nobody else.
    const dir = fs.statSync(hostPath);
    expect({ uid: dir.uid, gid: dir.gid, mode: (dir.mode & 0o777).toString(8) }).toEqual({ uid, gid, mode: '750' });
    for (const name of ['vmmd.sock', 'vmmd.session.sock']) {
      const socket = fs.statSync(path.join(hostPath, name));
      expect({ name, gid: socket.gid, mode: (socket.mode & 0o777).toString(8) }).toEqual({
        name,
        gid: Number(flag(containerCommand, '--socket-group')),
        mode: '660',
      });
    }
    const exited = new Promise<number | null>((resolve) => child!.once('exit', resolve));
    child.kill('SIGTERM');
    expect(await exited).toBe(0);
  }, 60_000);

  test("the old DaemonSet's failure, kept as a check: a socket group not the process's own, without CAP_CHOWN, stops the start", async () => {
    fs.chownSync(hostPath, 10001, 10001);
    child = dropped(10001, 10001, ['node', 'bin/vmmd.js', '--backend', 'host', '--socket-dir', hostPath, '--socket-group', '2000'], environment(), ROOT);
    child.stdout!.on('data', (chunk) => (output += chunk));
    child.stderr!.on('data', (chunk) => (output += chunk));
    const code = await new Promise<number | null>((resolve) => child!.once('exit', resolve));
    expect(code).toBe(1);
    expect(output).toMatch(/vmmd cannot start: EPERM: operation not permitted, chown/);
  }, 30_000);

  test("the Dockerfile's ENTRYPOINT as its USER, and its HEALTHCHECK command", async () => {
    const [uid, gid] = dockerfile.user.split(':').map(Number);
    // The image's /run/vmmd: install -d -o 10001 -g 2000 -m 0750.
    fs.chownSync(hostPath, uid, gid);
    fs.chmodSync(hostPath, 0o750);
    const replaced = (command: string[]) => command.map((arg) => (arg === '/run/vmmd' ? hostPath : arg));
    child = dropped(uid, gid, replaced(dockerfile.entrypoint), { PATH: process.env.PATH, NODE_ENV: 'production' }, ROOT);
    child.stdout!.on('data', (chunk) => (output += chunk));
    child.stderr!.on('data', (chunk) => (output += chunk));
    await waitFor(
      'the HEALTHCHECK to pass',
      async () => {
        const check = execFileSync(
          'setpriv',
          [`--reuid=${uid}`, `--regid=${gid}`, '--clear-groups', '--bounding-set=-all', '--', ...replaced(dockerfile.healthcheck)],
          { cwd: ROOT, encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] },
        );
        return check;
      },
      child,
      () => output,
    );
    // Every 30 s for the container's life: it opens no session, so it writes nothing to the daemon's log
    // (the check ran synchronously: what the daemon wrote meanwhile is read now).
    await new Promise((resolve) => setTimeout(resolve, 1_000));
    expect(output).not.toMatch(/session opened|session closed/);
  }, 60_000);
});
