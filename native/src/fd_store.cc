#include "fd_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "errors.h"
#include "fd_passing.h"

namespace vmmd {
namespace {

// The kernel's limit on descriptors in one SCM_RIGHTS message (SCM_MAX_FD).
constexpr size_t kMaxFdsPerDatagram = 253;

// unixDgramConnect(path) -> fd: a datagram socket connected to path, for
// sending many notifications without a socket each.
Napi::Value UnixDgramConnect(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return Napi::Number::New(env, DatagramSocket(env, info[0].As<Napi::String>().Utf8Value(), false));
}

// unixDgramSendFds(target, data, fds): one datagram with up to 253
// descriptors, to a path (a socket made for it, as sd_pid_notify_with_fds
// does) or on a socket from unixDgramConnect; sent blocking: the store holds
// its own copies once this returns.
Napi::Value UnixDgramSendFds(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  bool connected = info[0].IsNumber();
  std::string path = connected ? std::string() : info[0].As<Napi::String>().Utf8Value();
  if (!info[1].IsBuffer()) ThrowArg(env, "data must be a Buffer");
  Napi::Buffer<uint8_t> data = info[1].As<Napi::Buffer<uint8_t>>();
  if (!info[2].IsArray()) ThrowArg(env, "fds must be an array");
  Napi::Array list = info[2].As<Napi::Array>();
  if (list.Length() > kMaxFdsPerDatagram) ThrowArg(env, "at most 253 descriptors travel in one datagram");
  std::vector<int> fds(list.Length());
  for (uint32_t i = 0; i < list.Length(); i++) fds[i] = list.Get(i).As<Napi::Number>().Int32Value();
  sockaddr_un address;
  socklen_t length = 0;
  int sock;
  if (connected) {
    sock = info[0].As<Napi::Number>().Int32Value();
  } else {
    length = DatagramAddress(env, path, &address);
    sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (sock < 0) ThrowErrno(env, "socket(AF_UNIX, SOCK_DGRAM)");
  }
  ssize_t sent = SendWithRights(sock, data.Data(), data.Length(), fds.data(), fds.size(), MSG_NOSIGNAL, connected ? nullptr : &address, length);
  int err = errno;
  if (!connected) close(sock);
  if (sent < 0) throw ErrnoError(env, err, connected ? "sendmsg" : "sendmsg(" + path + ")");
  return env.Undefined();
}

// unixDgramRecvFds(fd, maxLength) -> null when nothing waits; else { data,
// fds, truncated }: every descriptor the datagram carried (close-on-exec).
Napi::Value UnixDgramRecvFds(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  int fd = FdArg(info, 0, "fd");
  uint32_t maxLength = info[1].As<Napi::Number>().Uint32Value();
  std::vector<uint8_t> buffer(maxLength > 0 ? maxLength : 1);
  std::vector<char> control(CMSG_SPACE(sizeof(int) * kMaxFdsPerDatagram) + CMSG_SPACE(sizeof(ucred)));
  std::vector<int> received;
  int flags = 0;
  ssize_t length = ReceiveWithRights(fd, buffer.data(), buffer.size(), control.data(), control.size(), &received, &flags);
  if (length < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return env.Null();
    ThrowErrno(env, "recvmsg");
  }
  Napi::Array fds = Napi::Array::New(env, received.size());
  for (uint32_t i = 0; i < received.size(); i++) fds.Set(i, Napi::Number::New(env, received[i]));
  Napi::Object out = Napi::Object::New(env);
  out.Set("data", Napi::Buffer<uint8_t>::Copy(env, buffer.data(), static_cast<size_t>(length)));
  out.Set("fds", fds);
  out.Set("truncated", Napi::Boolean::New(env, (flags & (MSG_TRUNC | MSG_CTRUNC)) != 0));
  return out;
}

// setCloseOnExec(fd, on): descriptors inherited at start (LISTEN_FDS) are
// not for the daemon's own children.
Napi::Value SetCloseOnExec(const Napi::CallbackInfo& info) {
  int fd = FdArg(info, 0, "fd");
  bool on = info[1].As<Napi::Boolean>().Value();
  int flags = fcntl(fd, F_GETFD);
  if (flags < 0) ThrowErrno(info.Env(), "fcntl(F_GETFD)");
  if (fcntl(fd, F_SETFD, on ? (flags | FD_CLOEXEC) : (flags & ~FD_CLOEXEC)) != 0) ThrowErrno(info.Env(), "fcntl(F_SETFD)");
  return info.Env().Undefined();
}

// stateMemfdCreate(name) -> fd: an empty memfd that grows (the parked
// state's journal), owner-only: no seals, as it is appended to for its life.
Napi::Value StateMemfdCreate(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string name = info[0].As<Napi::String>().Utf8Value();
  int fd = memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0) ThrowErrno(env, "memfd_create(" + name + ")");
  if (fchmod(fd, 0600) != 0) {
    int err = errno;
    close(fd);
    throw ErrnoError(env, err, "fchmod");
  }
  return Napi::Number::New(env, fd);
}

}  // namespace

void InitFdStore(Napi::Env env, Napi::Object exports) {
  exports.Set("unixDgramConnect", Napi::Function::New(env, UnixDgramConnect, "unixDgramConnect"));
  exports.Set("unixDgramSendFds", Napi::Function::New(env, UnixDgramSendFds, "unixDgramSendFds"));
  exports.Set("unixDgramRecvFds", Napi::Function::New(env, UnixDgramRecvFds, "unixDgramRecvFds"));
  exports.Set("stateMemfdCreate", Napi::Function::New(env, StateMemfdCreate, "stateMemfdCreate"));
  exports.Set("setCloseOnExec", Napi::Function::New(env, SetCloseOnExec, "setCloseOnExec"));
}

}  // namespace vmmd
