// The export table of the vmmd addon, and nothing else: one file per area.
#include <napi.h>

#include "busy_poll.h"
#include "cuda_driver.h"
#include "faults.h"
#include "fd_passing.h"
#include "fd_store.h"
#include "host_memory.h"
#include "thread_clock.h"

namespace {

Napi::Object Init(Napi::Env env, Napi::Object exports) {
  vmmd::faults::Init(env, exports);
  vmmd::InitHostMemory(env, exports);
  vmmd::InitFdPassing(env, exports);
  vmmd::InitFdStore(env, exports);
  vmmd::InitCudaDriver(env, exports);
  vmmd::InitBusyPoll(env, exports);
  vmmd::InitThreadClock(env, exports);
  return exports;
}

}  // namespace

NODE_API_MODULE(vmmd_native, Init)
