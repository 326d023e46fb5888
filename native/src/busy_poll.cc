// Busy polling before the event loop sleeps (see busy_poll.h).
//
// Why: on the virtual machines GPUs are rented on, a thread asleep in epoll
// is woken by an inter-processor interrupt that the hypervisor delivers, and
// the sender pays for it inside sendmsg(): most of a session round trip
// between two idle processes is those wake-ups, not the daemon's work
// (BENCHMARKS.md). A thread that spins instead of
// sleeping is found awake: no interrupt, no wake-up.
//
// How: a uv_prepare handle runs right before libuv computes its poll timeout
// and blocks in epoll_wait. When spinning is on (a budget above zero) and the
// loop would block (uv_backend_timeout is not 0: no immediate, pending or
// closing work), it calls epoll_wait on the loop's own epoll descriptor with
// a zero timeout until something is ready, the budget is spent, or the next
// timer is due. It reads nothing: libuv's epoll watches are level-triggered,
// so what was ready is still ready when libuv's own epoll_wait runs next,
// which then returns at once. The spin never runs past a timer, never delays
// work that is already due, and never keeps the loop alive (the handle is
// unreferenced).
#include "busy_poll.h"

#include <sched.h>
#include <sys/epoll.h>
#include <time.h>
#include <uv.h>

#include <cstdint>

#include "errors.h"

namespace vmmd {
namespace {

struct BusyPoll {
  uv_prepare_t prepare;
  // Spin at most this long before each sleep; 0: never spin.
  uint64_t budgetNs = 0;
  // Spins begun and spins that ended with something ready (stats for tests and metrics).
  double prepares = 0;
  double spins = 0;
  double caught = 0;
  double spunNs = 0;
};

uint64_t NowNs() {
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<uint64_t>(now.tv_sec) * 1000000000u + static_cast<uint64_t>(now.tv_nsec);
}

void OnPrepare(uv_prepare_t* handle) {
  auto* poll = static_cast<BusyPoll*>(handle->data);
  poll->prepares++;
  if (poll->budgetNs == 0) return;
  uv_loop_t* loop = handle->loop;
  int timeoutMs = uv_backend_timeout(loop);
  if (timeoutMs == 0) return;  // work is due now: the loop will not sleep
  uint64_t budget = poll->budgetNs;
  if (timeoutMs > 0 && static_cast<uint64_t>(timeoutMs) * 1000000u < budget) budget = static_cast<uint64_t>(timeoutMs) * 1000000u;
  int epollFd = uv_backend_fd(loop);
  if (epollFd < 0) return;
  poll->spins++;
  uint64_t start = NowNs();
  uint64_t now = start;
  epoll_event event;
  while (now - start < budget) {
    int ready = epoll_wait(epollFd, &event, 1, 0);
    if (ready != 0) {
      // Ready (or an error, which libuv's own epoll_wait will meet and handle).
      if (ready > 0) poll->caught++;
      break;
    }
    // Yield, not just pause: a thread this process (or its peer) needs now, a driver or libuv worker
    // thread woken for the very work being waited for, must not queue behind the spin where cores are few.
    sched_yield();
    now = NowNs();
  }
  poll->spunNs += static_cast<double>(NowNs() - start);
}

// One per thread's event loop (the main thread's, or a worker's), made on first use, closed at the
// environment's teardown. (Thread-local rather than the addon's instance data, which is one slot for all.)
thread_local BusyPoll* threadPoll = nullptr;

BusyPoll* ForEnv(Napi::Env env) {
  if (threadPoll != nullptr) return threadPoll;
  uv_loop_t* loop = nullptr;
  if (napi_get_uv_event_loop(env, &loop) != napi_ok || loop == nullptr) ThrowArg(env, "no event loop");
  auto* poll = new BusyPoll();
  int rc = uv_prepare_init(loop, &poll->prepare);
  if (rc != 0) {
    delete poll;
    throw ErrnoError(env, -rc, "uv_prepare_init");
  }
  poll->prepare.data = poll;
  uv_prepare_start(&poll->prepare, OnPrepare);
  // Never what keeps the process alive.
  uv_unref(reinterpret_cast<uv_handle_t*>(&poll->prepare));
  napi_add_env_cleanup_hook(
      env,
      [](void* data) {
        auto* closing = static_cast<BusyPoll*>(data);
        if (threadPoll == closing) threadPoll = nullptr;
        uv_prepare_stop(&closing->prepare);
        uv_close(reinterpret_cast<uv_handle_t*>(&closing->prepare), [](uv_handle_t* closed) { delete static_cast<BusyPoll*>(closed->data); });
      },
      poll);
  threadPoll = poll;
  return poll;
}

// busyPoll(microseconds) -> undefined: from now on, spin up to that long before each sleep of this
// thread's event loop (0: never). Cheap enough to call around each request.
Napi::Value SetBusyPoll(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 1 || !info[0].IsNumber()) ThrowArg(env, "busyPoll(microseconds): microseconds must be a number");
  double micros = info[0].As<Napi::Number>().DoubleValue();
  if (!(micros >= 0) || micros > 1000000) ThrowArg(env, "busyPoll: microseconds must be between 0 and 1000000, got " + std::to_string(micros));
  ForEnv(env)->budgetNs = static_cast<uint64_t>(micros * 1000);
  return env.Undefined();
}

// busyPollStats() -> { spins, caught, spunMicroseconds }: spins begun, those that found something ready, time spun.
Napi::Value BusyPollStats(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  BusyPoll* poll = ForEnv(env);
  Napi::Object stats = Napi::Object::New(env);
  stats.Set("prepares", poll->prepares);
  stats.Set("spins", poll->spins);
  stats.Set("caught", poll->caught);
  stats.Set("spunMicroseconds", poll->spunNs / 1000);
  return stats;
}

}  // namespace

void InitBusyPoll(Napi::Env env, Napi::Object exports) {
  exports.Set("busyPoll", Napi::Function::New(env, SetBusyPoll, "busyPoll"));
  exports.Set("busyPollStats", Napi::Function::New(env, BusyPollStats, "busyPollStats"));
}

}  // namespace vmmd
