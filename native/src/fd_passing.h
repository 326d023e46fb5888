// The session socket's mechanism: AF_UNIX SOCK_SEQPACKET sockets, descriptor
// passing with SCM_RIGHTS, peer credentials with SO_PEERCRED, and a libuv
// poller that tells JavaScript when a socket is readable. The protocol itself
// (framing, transfer ids) lives in TypeScript.
#pragma once

#include <napi.h>

namespace vmmd {
void InitFdPassing(Napi::Env env, Napi::Object exports);
}
