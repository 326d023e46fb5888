/**
 * The edges allowed between the source folders, checked by `npm run lint`
 * (part of `npm test`). The daemon is layered top to bottom:
 *   server/main.ts → server/app → server/lifecycle → server/transport/{grpc,session} → server/stores
 *   → server/registry → server/backends → native → common
 * and no file imports one of a layer above it. observability/ is read by every
 * layer (turns, GC pauses, the log limiter); only its metrics read the layers
 * they report on. The client reaches the addon through its own small modules.
 */
const layer = (name, from, above) => ({
  name,
  comment: `${from} imports nothing of the layers above it`,
  severity: 'error',
  from: { path: from },
  to: { path: above },
});

module.exports = {
  forbidden: [
    {
      name: 'no-circular',
      comment: 'no import circle, type-only imports included',
      severity: 'error',
      from: {},
      to: { circular: true },
    },
    layer('app-not-up', '^server/app/', '^server/main\\.ts$'),
    layer('lifecycle-not-up', '^server/lifecycle/', '^server/(main\\.ts|app/)'),
    layer('transport-not-up', '^server/transport/', '^server/(main\\.ts|app/|lifecycle/)'),
    {
      name: 'transports-apart',
      comment: 'the session transport knows nothing of the gRPC one (what both need lives in server/transport/ itself)',
      severity: 'error',
      from: { path: '^server/transport/session/' },
      to: { path: '^server/transport/grpc/' },
    },
    layer('stores-not-up', '^server/stores/', '^server/(main\\.ts|app/|lifecycle/|transport/)'),
    layer('registry-not-up', '^server/registry/', '^server/(main\\.ts|app/|lifecycle/|transport/|stores/)'),
    layer('backends-not-up', '^server/backends/', '^server/(main\\.ts|app/|lifecycle/|transport/|stores/|registry/)'),
    layer(
      'observability-not-up',
      '^server/observability/(turns|gc-pauses|log-limiter)\\.ts$',
      '^server/(main\\.ts|app/|transport/|stores/|registry/|backends/)',
    ),
    layer(
      'server-roots-not-up',
      '^(server/(errors|serial-queue)\\.ts)$',
      '^server/(?!errors\\.ts$|serial-queue\\.ts$|observability/(turns|gc-pauses|log-limiter)\\.ts$)',
    ),
    layer('native-not-up', '^native/', '^(server|client)/'),
    layer('common-not-up', '^common/', '^(server|client|native)/'),
    {
      name: 'client-not-server',
      comment: 'the client library never imports the daemon',
      severity: 'error',
      from: { path: '^client/' },
      to: { path: '^server/' },
    },
    {
      name: 'client-addon-surface',
      comment: 'the client reaches native code only through native/client, mapping, seqpacket and busy-poll',
      severity: 'error',
      from: { path: '^client/' },
      to: { path: '^native/', pathNot: '^native/(client|mapping|seqpacket|busy-poll)\\.ts$' },
    },
  ],
  options: {
    doNotFollow: { path: 'node_modules' },
    exclude: { path: '^(node_modules|dist|generated)/' },
    tsPreCompilationDeps: true,
    tsConfig: { fileName: 'tsconfig.json' },
  },
};
