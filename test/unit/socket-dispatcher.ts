/**
 * The session dispatcher over the RPCs' own service methods, as server/app/daemon.ts wires it, for tests that
 * run it without a daemon (the services' session manager and staging are not reached by the socket's requests).
 */
import { Registry } from '../../server/registry';
import { StoreRegistry } from '../../server/stores/stores';
import type { StagingBuffers } from '../../server/stores/staging';
import { VirtualMemoryService } from '../../server/transport/grpc/services/virtual-memory';
import { StoresService } from '../../server/transport/grpc/services/stores';
import { type DispatcherDeps, SessionDispatcher } from '../../server/transport/session/session-dispatcher';
import type { SessionManager } from '../../server/transport/session/sessions';

export function socketDispatcher(registry: Registry, extra: Partial<DispatcherDeps> = {}, stores = new StoreRegistry(registry)): SessionDispatcher {
  const vmm = new VirtualMemoryService(registry, {} as SessionManager, {} as StagingBuffers);
  const storesService = new StoresService(registry, stores, {} as SessionManager);
  return new SessionDispatcher({
    registry,
    methods: {
      allocate: (request, context) => vmm.allocate(request, context),
      release: (request, context) => vmm.release(request, context),
      share: (request, context) => vmm.share(request, context),
      export: (request, context) => vmm.export(request, context),
      open: (request, context) => storesService.open(request, context),
    },
    reclaimers: [],
    ...extra,
  });
}
