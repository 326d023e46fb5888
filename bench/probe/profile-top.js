// Where a V8 CPU profile (.cpuprofile, e.g. the daemon's from bench/run.js --profile DIR) spends its time:
// the top functions by self and by inclusive time. Usage: node bench/probe/profile-top.js FILE [N]
const prof = JSON.parse(require('fs').readFileSync(process.argv[2]));
const nodes = new Map(prof.nodes.map(n => [n.id, n]));
const parent = new Map(); for (const n of prof.nodes) for (const c of n.children || []) parent.set(c, n.id);
const self = new Map(); const dt = prof.timeDeltas; 
prof.samples.forEach((id, i) => self.set(id, (self.get(id) || 0) + (dt[i] || 0)));
const total = [...self.values()].reduce((a, b) => a + b, 0);
const selfBy = new Map(), inclBy = new Map();
const key = n => `${n.callFrame.functionName || '(anon)'} ${n.callFrame.url.replace(/.*\/vmmd\//, '').replace(/.*\/work\/main\//, '')}:${n.callFrame.lineNumber+1}`;
for (const [id, t] of self) {
  const n = nodes.get(id); selfBy.set(key(n), (selfBy.get(key(n)) || 0) + t);
  const seen = new Set(); let cur = id;
  while (cur !== undefined) { const k = key(nodes.get(cur)); if (!seen.has(k)) { inclBy.set(k, (inclBy.get(k) || 0) + t); seen.add(k); } cur = parent.get(cur); }
}
const show = (m, title) => { console.log('==', title); [...m].sort((a, b) => b[1] - a[1]).slice(0, +process.argv[3] || 40).forEach(([k, t]) => console.log((t / 1000).toFixed(0).padStart(7), 'ms', (100 * t / total).toFixed(1).padStart(5) + '%', k)); };
show(selfBy, 'self'); show(inclBy, 'inclusive');
