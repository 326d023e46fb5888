// Issue 18 diagnostic (cuda): what the daemon's answer to an allocate costs after the driver work:
// close() of a dup of a CUDA export descriptor (the kernel or a kept dup still holds the file), and
// sendmsg with the descriptor attached, over a SEQPACKET pair on this host (per call, µs).
//   node bench/probe/fd-costs.js VMMD_DIR
const dir = process.argv[2] || '.';
const { addon } = require(`${dir}/dist/native`);
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const N = 2000;
const p50 = (a) => a.sort((x, y) => x - y)[a.length >> 1].toFixed(2);
(async () => {
  // Without CUDA (a check of the script): a memfd.
  const cuda = addon.cudaLoad().loaded;
  const handle = cuda ? await addon.cudaCreate(0, 1, 0, 2n << 20n, 1, true) : undefined;
  const fd = cuda ? await addon.cudaExportFd(0, handle) : addon.hostMemfdCreate('fd-costs', 2n << 20n);
  console.log(cuda ? 'a CUDA export descriptor' : 'a memfd (no CUDA here)');
  const sock = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'fdc-')), 's');
  const listen = addon.seqpacketListen(sock, 16);
  const a = addon.seqpacketConnect(sock);
  await new Promise((r) => setTimeout(r, 50));
  const b = addon.seqpacketAccept(listen).fd;
  const closeDup = [], send = [], closeSent = [], recvClose = [], sendPlain = [];
  const data = Buffer.from(JSON.stringify({ type: 'allocated', request: '1', allocation: '2', size: '2097152' }));
  for (let i = 0; i < N; i++) {
    const d = addon.dup(fd);
    let t = process.hrtime.bigint();
    addon.close(d);
    closeDup.push(Number(process.hrtime.bigint() - t) / 1000);
    const e = addon.dup(fd);
    t = process.hrtime.bigint();
    addon.seqpacketSend(a, data, e);
    send.push(Number(process.hrtime.bigint() - t) / 1000);
    t = process.hrtime.bigint();
    addon.close(e);
    closeSent.push(Number(process.hrtime.bigint() - t) / 1000);
    const got = addon.seqpacketRecv(b, 4096);
    t = process.hrtime.bigint();
    addon.close(got.fd);
    recvClose.push(Number(process.hrtime.bigint() - t) / 1000);
    t = process.hrtime.bigint();
    addon.seqpacketSend(a, data, -1);
    sendPlain.push(Number(process.hrtime.bigint() - t) / 1000);
    addon.seqpacketRecv(b, 4096);
  }
  console.log(`p50 µs over ${N}: close(dup of an export fd) ${p50(closeDup)}; sendmsg with it ${p50(send)}; close(it) after the send ${p50(closeSent)}; close(received copy) ${p50(recvClose)}; sendmsg without a descriptor ${p50(sendPlain)}`);
  addon.close(fd);
  if (cuda) await addon.cudaRelease(0, handle);
})().catch((e) => { console.error(e); process.exit(1); });
