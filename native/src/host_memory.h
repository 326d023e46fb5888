// Host memory: memfd-backed allocations mapped into PROT_NONE reservations,
// the host backend's equivalent of cuMemCreate / cuMemAddressReserve / cuMemMap.
// Mechanism only: the registry in TypeScript validates every range first.
#pragma once

#include <napi.h>

namespace vmmd {
void InitHostMemory(Napi::Env env, Napi::Object exports);
}
