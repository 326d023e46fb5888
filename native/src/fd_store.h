// systemd's file-descriptor store protocol, on the wire: datagrams to
// NOTIFY_SOCKET carrying many descriptors with SCM_RIGHTS (what
// sd_pid_notify_with_fds sends), and receiving them (what vmmd's keeper, a
// stand-in of systemd's store, does). Which descriptors and names travel is
// decided in TypeScript (server/lifecycle/).
#pragma once

#include <napi.h>

namespace vmmd {
void InitFdStore(Napi::Env env, Napi::Object exports);
}
