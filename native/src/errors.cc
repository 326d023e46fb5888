#include "errors.h"

#include <cerrno>
#include <cstring>

namespace vmmd {

std::string ErrnoName(int err) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 32))
  const char* name = strerrorname_np(err);
  if (name != nullptr) return name;
#endif
  return "E" + std::to_string(err);
}

Napi::Error ErrnoError(Napi::Env env, int err, const std::string& call) {
  std::string name = ErrnoName(err);
  Napi::Error error = Napi::Error::New(env, name + ": " + call + ": " + std::strerror(err));
  error.Set("code", Napi::String::New(env, name));
  error.Set("errno", Napi::Number::New(env, err));
  error.Set("syscall", Napi::String::New(env, call.substr(0, call.find('('))));
  return error;
}

void ThrowErrno(Napi::Env env, const std::string& call) {
  int err = errno;
  throw ErrnoError(env, err, call);
}

void ThrowArg(Napi::Env env, const std::string& message) {
  Napi::TypeError error = Napi::TypeError::New(env, message);
  error.Set("code", Napi::String::New(env, "ERR_INVALID_ARG"));
  throw error;
}

uint64_t U64Arg(const Napi::CallbackInfo& info, size_t index, const char* name) {
  Napi::Value value = info[index];
  if (value.IsBigInt()) {
    bool lossless = false;
    uint64_t result = value.As<Napi::BigInt>().Uint64Value(&lossless);
    if (!lossless) ThrowArg(info.Env(), std::string(name) + " does not fit in 64 bits");
    return result;
  }
  if (value.IsNumber()) {
    double number = value.As<Napi::Number>().DoubleValue();
    if (number < 0 || number > 9007199254740991.0 || number != static_cast<double>(static_cast<uint64_t>(number))) {
      ThrowArg(info.Env(), std::string(name) + " must be a non-negative integer");
    }
    return static_cast<uint64_t>(number);
  }
  ThrowArg(info.Env(), std::string(name) + " must be a number or bigint");
}

int FdArg(const Napi::CallbackInfo& info, size_t index, const char* name) {
  if (!info[index].IsNumber()) ThrowArg(info.Env(), std::string(name) + " must be a file descriptor number");
  int fd = info[index].As<Napi::Number>().Int32Value();
  if (fd < 0) ThrowArg(info.Env(), std::string(name) + " must be a file descriptor (>= 0)");
  return fd;
}

}  // namespace vmmd
