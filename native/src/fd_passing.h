// The session socket's mechanism: AF_UNIX SOCK_SEQPACKET sockets, descriptor
// passing with SCM_RIGHTS, peer credentials with SO_PEERCRED, and a libuv
// poller that tells JavaScript when a socket is readable. The protocol itself
// (framing, transfer ids) lives in TypeScript.
#pragma once

#include <napi.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <string>
#include <vector>

namespace vmmd {
void InitFdPassing(Napi::Env env, Napi::Object exports);

// The address of a datagram socket: a path, or (leading '@') an abstract name,
// as NOTIFY_SOCKET gives it; throws ENAMETOOLONG for one that does not fit.
socklen_t DatagramAddress(Napi::Env env, const std::string& path, sockaddr_un* address);

// A datagram socket (close-on-exec, `flags` added to its type: SOCK_NONBLOCK) bound to `path`, to receive on,
// or connected to it, to send there alone; throws naming the call that failed.
int DatagramSocket(Napi::Env env, const std::string& path, bool bound, int flags = 0);

// One sendmsg(2) of `data` with `count` descriptors riding it as SCM_RIGHTS (none when 0), to `to` when
// given (an unconnected datagram socket), retried on EINTR. Returns sendmsg's result; on -1 errno says why.
// `fault` names the call for fault injection (faults.h), or is nullptr.
ssize_t SendWithRights(int sock, const uint8_t* data, size_t length, const int* fds, size_t count, int flags, const sockaddr_un* to = nullptr,
                       socklen_t toLength = 0, const char* fault = nullptr);

// One recvmsg(2) without blocking, retried on EINTR: at most `length` bytes of the message into `data`, the
// descriptors it carried (SCM_RIGHTS, close-on-exec, in order) appended to `fds`, its msg_flags (MSG_TRUNC,
// MSG_CTRUNC) in `flags`. `control` (aligned for cmsghdr, `controlLength` bytes) bounds the descriptors taken:
// the kernel closes those past it and sets MSG_CTRUNC. Returns recvmsg's result; on -1 errno says why.
ssize_t ReceiveWithRights(int sock, uint8_t* data, size_t length, char* control, size_t controlLength, std::vector<int>* fds, int* flags);
}
