// The calling thread's own CPU time (CLOCK_THREAD_CPUTIME_ID): how long the
// thread actually ran, not counting the time the OS had it off the CPU. The
// daemon's turn meter reads it around each turn (server/turns.ts).
#pragma once

#include <napi.h>

namespace vmmd {
void InitThreadClock(Napi::Env env, Napi::Object exports);
}
