// Issue 18 diagnostic: what a clock read and a histogram observation cost on this host (per call, ns).
// node bench/probe/clock-cost.js VMMD_DIR
const dir = process.argv[2] || '.';
const { addon } = require(`${dir}/dist/native`);
const client = require(`${dir}/node_modules/prom-client`);
const N = 200000;
function time(name, fn) {
  for (let i = 0; i < 10000; i++) fn();
  const start = process.hrtime.bigint();
  for (let i = 0; i < N; i++) fn();
  const ns = Number(process.hrtime.bigint() - start) / N;
  console.log(`${name.padEnd(48)} ${ns.toFixed(1)} ns`);
}
const h = new client.Histogram({ name: 'x_seconds', help: 'x', labelNames: ['kind'], buckets: [1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1] });
const child = h.labels('io');
time('addon.threadCpuNanos() (CLOCK_THREAD_CPUTIME_ID)', () => addon.threadCpuNanos());
time('process.hrtime.bigint()', () => process.hrtime.bigint());
time('performance.now()', () => performance.now());
time('prom-client histogram.observe({kind}, v)', () => h.observe({ kind: 'io' }, 0.00001));
time('prom-client labelled child.observe(v)', () => child.observe(0.00001));
time('JSON.stringify of an allocated answer', () => JSON.stringify({ type: 'allocated', request: '12345', allocation: '678', size: '2097152', device: 0, deviceUuid: 'GPU-12345678-1234-1234-1234-123456789abc', granularity: '2097152', location: { type: 'DEVICE', id: 0 } }));
