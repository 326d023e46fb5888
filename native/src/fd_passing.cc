#include "fd_passing.h"

#include <fcntl.h>
#include <poll.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <uv.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "errors.h"
#include "faults.h"

namespace vmmd {
namespace {

// The most descriptors one received message may carry before the extras are
// closed; the protocol allows one, a hostile peer may send more.
constexpr int kMaxReceivedFds = 16;

sockaddr_un SocketAddress(Napi::Env env, const std::string& path) {
  sockaddr_un address;
  std::memset(&address, 0, sizeof(address));
  address.sun_family = AF_UNIX;
  if (path.size() >= sizeof(address.sun_path)) {
    throw ErrnoError(env, ENAMETOOLONG, "socket path '" + path + "' is longer than " +
                                            std::to_string(sizeof(address.sun_path) - 1) + " bytes");
  }
  std::memcpy(address.sun_path, path.c_str(), path.size());
  return address;
}

Napi::Object Credentials(Napi::Env env, int fd) {
  ucred cred;
  socklen_t length = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &length) != 0) ThrowErrno(env, "getsockopt(SO_PEERCRED)");
  Napi::Object out = Napi::Object::New(env);
  out.Set("pid", Napi::Number::New(env, cred.pid));
  out.Set("uid", Napi::Number::New(env, cred.uid));
  out.Set("gid", Napi::Number::New(env, cred.gid));
  // The peer's supplementary groups as they were at connect(), as SO_PEERCRED's ids are
  // (Linux 4.13+). Left out where the kernel has no SO_PEERGROUPS: the caller decides.
  std::vector<gid_t> groups(32);
  for (;;) {
    socklen_t size = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &size) == 0) {
      groups.resize(size / sizeof(gid_t));
      break;
    }
    if (errno == ERANGE && size > groups.size() * sizeof(gid_t)) {
      groups.resize(size / sizeof(gid_t));
      continue;
    }
    if (errno == ENOPROTOOPT) return out;
    ThrowErrno(env, "getsockopt(SO_PEERGROUPS)");
  }
  Napi::Array list = Napi::Array::New(env, groups.size());
  for (size_t i = 0; i < groups.size(); i++) list.Set(static_cast<uint32_t>(i), Napi::Number::New(env, groups[i]));
  out.Set("groups", list);
  return out;
}

// socketUnsentBytes(fd) -> the bytes this socket sent that its peer has not
// read yet (SIOCOUTQ: on a Unix socket, the send buffer the peer's unread
// messages still hold). 0 means the peer has read everything, the descriptors
// that came with it included.
Napi::Value SocketUnsentBytes(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  int fd = info[0].As<Napi::Number>().Int32Value();
  int queued = 0;
  if (ioctl(fd, SIOCOUTQ, &queued) != 0) ThrowErrno(env, "ioctl(SIOCOUTQ)");
  return Napi::Number::New(env, queued);
}

// parentDeathSignal(signal): the kernel sends `signal` to this
// process when the thread that started it ends (PR_SET_PDEATHSIG). Whether to ask is the
// TypeScript layer's choice.
Napi::Value ParentDeathSignal(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  int signal = info[0].As<Napi::Number>().Int32Value();
  if (prctl(PR_SET_PDEATHSIG, signal) != 0) ThrowErrno(env, "prctl(PR_SET_PDEATHSIG)");
  return env.Undefined();
}

// descriptorLimit(soft?) -> { soft, hard }: RLIMIT_NOFILE, after setting the
// soft limit when one is given (how far is the TypeScript layer's choice).
Napi::Value DescriptorLimit(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  rlimit limit;
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) ThrowErrno(env, "getrlimit(RLIMIT_NOFILE)");
  if (info.Length() > 0 && !info[0].IsUndefined()) {
    limit.rlim_cur = static_cast<rlim_t>(info[0].As<Napi::Number>().Int64Value());
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) ThrowErrno(env, "setrlimit(RLIMIT_NOFILE)");
  }
  Napi::Object out = Napi::Object::New(env);
  out.Set("soft", Napi::Number::New(env, static_cast<double>(limit.rlim_cur)));
  out.Set("hard", Napi::Number::New(env, static_cast<double>(limit.rlim_max)));
  return out;
}

// seqpacketListen(path, backlog) -> fd (non-blocking, close-on-exec).
Napi::Value SeqpacketListen(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string path = info[0].As<Napi::String>().Utf8Value();
  int backlog = info[1].As<Napi::Number>().Int32Value();
  sockaddr_un address = SocketAddress(env, path);
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) ThrowErrno(env, "socket(AF_UNIX, SOCK_SEQPACKET)");
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 || listen(fd, backlog) != 0) {
    int err = errno;
    close(fd);
    throw ErrnoError(env, err, "bind(" + path + ")");
  }
  return Napi::Number::New(env, fd);
}

// seqpacketConnect(path) -> fd (non-blocking once connected).
Napi::Value SeqpacketConnect(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string path = info[0].As<Napi::String>().Utf8Value();
  sockaddr_un address = SocketAddress(env, path);
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) ThrowErrno(env, "socket(AF_UNIX, SOCK_SEQPACKET)");
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    int err = errno;
    close(fd);
    throw ErrnoError(env, err, "connect(" + path + ")");
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  return Napi::Number::New(env, fd);
}

// seqpacketAccept(listenFd) -> { fd, pid, uid, gid } or null when none waits.
Napi::Value SeqpacketAccept(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  int listenFd = FdArg(info, 0, "listenFd");
  int fd = accept4(listenFd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED) return env.Null();
    ThrowErrno(env, "accept4");
  }
  Napi::Object out;
  try {
    out = Credentials(env, fd);
  } catch (...) {
    close(fd);
    throw;
  }
  out.Set("fd", Napi::Number::New(env, fd));
  return out;
}

// peerCredentials(fd) -> { pid, uid, gid, groups? }
Napi::Value PeerCredentials(const Napi::CallbackInfo& info) {
  return Credentials(info.Env(), FdArg(info, 0, "fd"));
}

// seqpacketSend(fd, data, passFd) -> true when sent, false when the socket's
// buffer is full (EAGAIN). passFd < 0 sends no descriptor.
Napi::Value SeqpacketSend(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  int fd = FdArg(info, 0, "fd");
  if (!info[1].IsBuffer()) ThrowArg(env, "data must be a Buffer");
  Napi::Buffer<uint8_t> data = info[1].As<Napi::Buffer<uint8_t>>();
  int passFd = info[2].As<Napi::Number>().Int32Value();

  ssize_t sent = SendWithRights(fd, data.Data(), data.Length(), &passFd, passFd >= 0 ? 1 : 0, MSG_NOSIGNAL | MSG_DONTWAIT, nullptr, 0, "sendmsg");
  if (sent < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return Napi::Boolean::New(env, false);
    ThrowErrno(env, "sendmsg");
  }
  return Napi::Boolean::New(env, true);
}

// Whether the peer of a connected socket has hung up (closed or shut down its side).
bool PeerHungUp(int fd) {
  pollfd entry = {fd, POLLRDHUP, 0};
  if (poll(&entry, 1, 0) < 0) return true;
  return (entry.revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0;
}

// seqpacketRecv(fd, maxLength) -> null when nothing waits; { eof: true } when
// the peer closed; else { data, fd, extraFds, truncated }. A message longer
// than maxLength is cut (truncated: true); descriptors beyond the first are
// closed here and counted in extraFds, so a hostile peer cannot leak them.
Napi::Value SeqpacketRecv(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  int fd = FdArg(info, 0, "fd");
  uint32_t maxLength = info[1].As<Napi::Number>().Uint32Value();
  std::vector<uint8_t> buffer(maxLength > 0 ? maxLength : 1);
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxReceivedFds)];
  std::vector<int> fds;
  int flags = 0;
  ssize_t received = ReceiveWithRights(fd, buffer.data(), buffer.size(), control, sizeof(control), &fds, &flags);
  // A peer that closed with a message of ours unread resets this side: the read reports it once, ahead of
  // what the peer sent before it closed (a daemon's refusal of the session), which is still queued.
  bool reset = received < 0 && errno == ECONNRESET;
  if (reset) received = ReceiveWithRights(fd, buffer.data(), buffer.size(), control, sizeof(control), &fds, &flags);
  if (received < 0) {
    if ((errno == EAGAIN || errno == EWOULDBLOCK) && !reset) return env.Null();
    if (errno == ECONNRESET || reset) {
      Napi::Object eof = Napi::Object::New(env);
      eof.Set("eof", Napi::Boolean::New(env, true));
      return eof;
    }
    ThrowErrno(env, "recvmsg");
  }
  int firstFd = fds.empty() ? -1 : fds[0];
  for (size_t i = 1; i < fds.size(); i++) close(fds[i]);
  int extraFds = fds.empty() ? 0 : static_cast<int>(fds.size() - 1);
  Napi::Object out = Napi::Object::New(env);
  // SEQPACKET: 0 bytes is the end of the stream, or an empty record that the
  // peer sent (a bad message, not a hang-up; nothing in recvmsg's flags tells
  // them apart). Only a peer that hung up shows POLLHUP / POLLRDHUP.
  if (received == 0 && firstFd < 0 && PeerHungUp(fd)) {
    out.Set("eof", Napi::Boolean::New(env, true));
    return out;
  }
  out.Set("data", Napi::Buffer<uint8_t>::Copy(env, buffer.data(), static_cast<size_t>(received)));
  out.Set("fd", Napi::Number::New(env, firstFd));
  out.Set("extraFds", Napi::Number::New(env, extraFds));
  out.Set("truncated", Napi::Boolean::New(env, (flags & MSG_TRUNC) != 0));
  out.Set("controlTruncated", Napi::Boolean::New(env, (flags & MSG_CTRUNC) != 0));
  return out;
}

// unixDgramSend(path, data): one datagram, as sd_notify(3) sends to NOTIFY_SOCKET.
Napi::Value UnixDgramSend(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string path = info[0].As<Napi::String>().Utf8Value();
  Napi::Buffer<uint8_t> data = info[1].As<Napi::Buffer<uint8_t>>();
  sockaddr_un address;
  socklen_t length = DatagramAddress(env, path, &address);
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) ThrowErrno(env, "socket(AF_UNIX, SOCK_DGRAM)");
  ssize_t sent = sendto(fd, data.Data(), data.Length(), MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&address), length);
  int err = errno;
  close(fd);
  if (sent < 0) throw ErrnoError(env, err, "sendto(" + path + ")");
  return env.Undefined();
}

// unixDgramBind(path) -> fd: a datagram socket to receive on (tests stand in for systemd with it).
Napi::Value UnixDgramBind(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return Napi::Number::New(env, DatagramSocket(env, info[0].As<Napi::String>().Utf8Value(), true, SOCK_NONBLOCK));
}

Napi::Value ShutdownSocket(const Napi::CallbackInfo& info) {
  int fd = FdArg(info, 0, "fd");
  if (shutdown(fd, SHUT_RDWR) != 0 && errno != ENOTCONN) ThrowErrno(info.Env(), "shutdown");
  return info.Env().Undefined();
}

// Poller(fd, callback(status, events)): calls back on the event loop while
// the descriptor is readable (or hung up). The poller does not own the fd.
class Poller : public Napi::ObjectWrap<Poller> {
 public:
  static Napi::Function Define(Napi::Env env) {
    return DefineClass(env, "Poller",
                       {InstanceMethod("start", &Poller::Start), InstanceMethod("stop", &Poller::Stop),
                        InstanceMethod("close", &Poller::Close), InstanceMethod("ref", &Poller::RefLoop),
                        InstanceMethod("unref", &Poller::UnrefLoop)});
  }

  explicit Poller(const Napi::CallbackInfo& info) : Napi::ObjectWrap<Poller>(info) {
    Napi::Env env = info.Env();
    int fd = FdArg(info, 0, "fd");
    if (!info[1].IsFunction()) ThrowArg(env, "callback must be a function");
    callback_ = Napi::Persistent(info[1].As<Napi::Function>());
    context_ = std::make_unique<Napi::AsyncContext>(env, "vmmd:poller");
    uv_loop_t* loop = nullptr;
    if (napi_get_uv_event_loop(env, &loop) != napi_ok) ThrowArg(env, "no event loop");
    handle_ = new uv_poll_t;
    int rc = uv_poll_init(loop, handle_, fd);
    if (rc != 0) {
      delete handle_;
      handle_ = nullptr;
      throw ErrnoError(env, -rc, "uv_poll_init");
    }
    handle_->data = this;
  }

  ~Poller() override { CloseHandle(); }

 private:
  static void OnPoll(uv_poll_t* handle, int status, int events) {
    Poller* self = static_cast<Poller*>(handle->data);
    if (self == nullptr) return;
    Napi::Env env = self->Env();
    Napi::HandleScope scope(env);
    try {
      self->callback_.MakeCallback(self->Value(), {Napi::Number::New(env, status), Napi::Number::New(env, events)},
                                   *self->context_);
    } catch (const Napi::Error& error) {
      napi_fatal_exception(env, error.Value());
    }
  }

  Napi::Value Start(const Napi::CallbackInfo& info) {
    if (handle_ == nullptr) ThrowArg(info.Env(), "poller is closed");
    int rc = uv_poll_start(handle_, UV_READABLE | UV_DISCONNECT, OnPoll);
    if (rc != 0) throw ErrnoError(info.Env(), -rc, "uv_poll_start");
    if (!active_) {
      active_ = true;
      Ref();  // keep the wrapper alive while libuv may call it
    }
    return info.Env().Undefined();
  }

  Napi::Value Stop(const Napi::CallbackInfo& info) {
    if (handle_ != nullptr) uv_poll_stop(handle_);
    if (active_) {
      active_ = false;
      Unref();
    }
    return info.Env().Undefined();
  }

  Napi::Value Close(const Napi::CallbackInfo& info) {
    Stop(info);
    CloseHandle();
    return info.Env().Undefined();
  }

  Napi::Value RefLoop(const Napi::CallbackInfo& info) {
    if (handle_ != nullptr) uv_ref(reinterpret_cast<uv_handle_t*>(handle_));
    return info.Env().Undefined();
  }

  Napi::Value UnrefLoop(const Napi::CallbackInfo& info) {
    if (handle_ != nullptr) uv_unref(reinterpret_cast<uv_handle_t*>(handle_));
    return info.Env().Undefined();
  }

  void CloseHandle() {
    if (handle_ == nullptr) return;
    handle_->data = nullptr;
    uv_close(reinterpret_cast<uv_handle_t*>(handle_), [](uv_handle_t* handle) { delete reinterpret_cast<uv_poll_t*>(handle); });
    handle_ = nullptr;
  }

  uv_poll_t* handle_ = nullptr;
  bool active_ = false;
  Napi::FunctionReference callback_;
  std::unique_ptr<Napi::AsyncContext> context_;
};

}  // namespace

ssize_t SendWithRights(int sock, const uint8_t* data, size_t length, const int* fds, size_t count, int flags, const sockaddr_un* to,
                       socklen_t toLength, const char* fault) {
  iovec iov{const_cast<uint8_t*>(data), length};
  msghdr message;
  std::memset(&message, 0, sizeof(message));
  if (to != nullptr) {
    message.msg_name = const_cast<sockaddr_un*>(to);
    message.msg_namelen = toLength;
  }
  message.msg_iov = &iov;
  message.msg_iovlen = 1;
  // One descriptor (the session socket's every answer) needs no allocation.
  alignas(cmsghdr) char one[CMSG_SPACE(sizeof(int))] = {};
  std::vector<char> many(count > 1 ? CMSG_SPACE(sizeof(int) * count) : 0);
  if (count > 0) {
    message.msg_control = count > 1 ? many.data() : one;
    message.msg_controllen = CMSG_SPACE(sizeof(int) * count);
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int) * count);
    std::memcpy(CMSG_DATA(header), fds, sizeof(int) * count);
  }
  ssize_t sent;
  do {
    sent = fault != nullptr && faults::Inject(fault) ? -1 : sendmsg(sock, &message, flags);
  } while (sent < 0 && errno == EINTR);
  return sent;
}

ssize_t ReceiveWithRights(int sock, uint8_t* data, size_t length, char* control, size_t controlLength, std::vector<int>* fds, int* flags) {
  iovec iov{data, length};
  msghdr message;
  std::memset(&message, 0, sizeof(message));
  message.msg_iov = &iov;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = controlLength;
  ssize_t received;
  do {
    received = recvmsg(sock, &message, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  } while (received < 0 && errno == EINTR);
  if (received < 0) return received;
  *flags = message.msg_flags;
  for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr; header = CMSG_NXTHDR(&message, header)) {
    if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
    size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; i++) {
      int passed;
      std::memcpy(&passed, CMSG_DATA(header) + i * sizeof(int), sizeof(int));
      fds->push_back(passed);
    }
  }
  return received;
}

socklen_t DatagramAddress(Napi::Env env, const std::string& path, sockaddr_un* address) {
  std::memset(address, 0, sizeof(*address));
  address->sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(address->sun_path)) {
    throw ErrnoError(env, ENAMETOOLONG, "socket address '" + path + "'");
  }
  std::memcpy(address->sun_path, path.c_str(), path.size());
  if (path[0] == '@') address->sun_path[0] = '\0';
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size());
}

int DatagramSocket(Napi::Env env, const std::string& path, bool bound, int flags) {
  sockaddr_un address;
  socklen_t length = DatagramAddress(env, path, &address);
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | flags, 0);
  if (fd < 0) ThrowErrno(env, "socket(AF_UNIX, SOCK_DGRAM)");
  sockaddr* to = reinterpret_cast<sockaddr*>(&address);
  if ((bound ? bind(fd, to, length) : connect(fd, to, length)) != 0) {
    int err = errno;
    close(fd);
    throw ErrnoError(env, err, std::string(bound ? "bind(" : "connect(") + path + ")");
  }
  return fd;
}

void InitFdPassing(Napi::Env env, Napi::Object exports) {
  exports.Set("seqpacketListen", Napi::Function::New(env, SeqpacketListen, "seqpacketListen"));
  exports.Set("seqpacketConnect", Napi::Function::New(env, SeqpacketConnect, "seqpacketConnect"));
  exports.Set("seqpacketAccept", Napi::Function::New(env, SeqpacketAccept, "seqpacketAccept"));
  exports.Set("seqpacketSend", Napi::Function::New(env, SeqpacketSend, "seqpacketSend"));
  exports.Set("seqpacketRecv", Napi::Function::New(env, SeqpacketRecv, "seqpacketRecv"));
  exports.Set("shutdownSocket", Napi::Function::New(env, ShutdownSocket, "shutdownSocket"));
  exports.Set("unixDgramSend", Napi::Function::New(env, UnixDgramSend, "unixDgramSend"));
  exports.Set("unixDgramBind", Napi::Function::New(env, UnixDgramBind, "unixDgramBind"));
  exports.Set("descriptorLimit", Napi::Function::New(env, DescriptorLimit, "descriptorLimit"));
  exports.Set("parentDeathSignal", Napi::Function::New(env, ParentDeathSignal, "parentDeathSignal"));
  exports.Set("peerCredentials", Napi::Function::New(env, PeerCredentials, "peerCredentials"));
  exports.Set("socketUnsentBytes", Napi::Function::New(env, SocketUnsentBytes, "socketUnsentBytes"));
  exports.Set("Poller", Poller::Define(env));
}

}  // namespace vmmd
