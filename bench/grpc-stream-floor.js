#!/usr/bin/env node
// The transport's own ceiling for streamed bytes: a bare grpc-js server stream
// of 1 MiB messages between two processes over a Unix socket, nothing else.
// vmmd's Read/Write cannot beat it; compare `npm run bench`'s streaming rows.
//   node bench/grpc-stream-floor.js            (starts its own server process)
'use strict';
const grpc = require('@grpc/grpc-js');
const { fork } = require('node:child_process');
const os = require('node:os');
const path = require('node:path');

const identity = (x) => x;
const service = {
  Pull: {
    path: '/floor.Floor/Pull',
    requestStream: false,
    responseStream: true,
    requestSerialize: identity,
    requestDeserialize: identity,
    responseSerialize: identity,
    responseDeserialize: identity,
  },
};
const CHUNK = Buffer.alloc(1 << 20, 7);
const CHUNKS = 256;
const socket = path.join(os.tmpdir(), `vmmd-floor-${process.pid}.sock`);

if (process.argv[2] === 'server') {
  const server = new grpc.Server();
  server.addService(service, {
    Pull: async (call) => {
      for (let i = 0; i < CHUNKS; i++) if (!call.write(CHUNK)) await new Promise((resolve) => call.once('drain', resolve));
      call.end();
    },
  });
  server.bindAsync(`unix://${process.argv[3]}`, grpc.ServerCredentials.createInsecure(), () => process.send('ready'));
} else {
  const child = fork(__filename, ['server', socket]);
  child.once('message', async () => {
    const Client = grpc.makeGenericClientConstructor(service);
    const client = new Client(`unix://${socket}`, grpc.credentials.createInsecure());
    const rates = [];
    for (let round = 0; round < 5; round++) {
      const start = process.hrtime.bigint();
      let bytes = 0;
      for await (const message of client.Pull(Buffer.alloc(0))) bytes += message.length;
      rates.push(bytes / (Number(process.hrtime.bigint() - start) / 1e9) / 1e9);
    }
    rates.sort((a, b) => a - b);
    console.log(`bare grpc-js server stream, 256 × 1 MiB over a Unix socket, 5 rounds: median ${rates[2].toFixed(2)} GB/s, best ${rates[4].toFixed(2)} GB/s`);
    client.close();
    child.kill();
  });
}
