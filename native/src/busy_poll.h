// Busy polling: before the event loop sleeps in epoll, it may spin a bounded
// while on the loop's own epoll descriptor instead, so that a message or a
// completion arriving soon finds the thread awake. The when and how long are
// policy, set from TypeScript; this is the mechanism.
#pragma once

#include <napi.h>

namespace vmmd {
void InitBusyPoll(Napi::Env env, Napi::Object exports);
}
