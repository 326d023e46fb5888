// The calling thread's CPU time (see thread_clock.h).
#include "thread_clock.h"

#include <time.h>

#include "errors.h"

namespace vmmd {
namespace {

// threadCpuNanos(): nanoseconds this thread has run, as a Number (exact to
// 2^53 ns, 104 days of CPU).
Napi::Value ThreadCpuNanos(const Napi::CallbackInfo& info) {
  timespec now;
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now) != 0) ThrowErrno(info.Env(), "clock_gettime");
  return Napi::Number::New(info.Env(), static_cast<double>(now.tv_sec) * 1e9 + static_cast<double>(now.tv_nsec));
}

}  // namespace

void InitThreadClock(Napi::Env env, Napi::Object exports) {
  exports.Set("threadCpuNanos", Napi::Function::New(env, ThreadCpuNanos, "threadCpuNanos"));
}
}  // namespace vmmd
