{
  "targets": [
    {
      "target_name": "vmmd_native",
      "sources": [
        "native/src/addon.cc",
        "native/src/errors.cc",
        "native/src/faults.cc",
        "native/src/host_memory.cc",
        "native/src/fd_passing.cc",
        "native/src/fd_store.cc",
        "native/src/cuda_driver.cc",
        "native/src/busy_poll.cc",
        "native/src/thread_clock.cc"
      ],
      "include_dirs": [
        "<!(node -p \"require('node-addon-api').include_dir\")",
        "<!(node -p \"require('fs').existsSync('/usr/local/cuda/include/cuda.h') ? '/usr/local/cuda/include' : 'native/src'\")"
      ],
      "defines": ["NAPI_VERSION=8", "NODE_ADDON_API_ENABLE_TYPE_CHECK_ON_AS"],
      "cflags_cc": ["-std=c++17", "-fexceptions", "-Wall", "-Wextra", "-Wno-unused-parameter"],
      "cflags_cc!": ["-fno-exceptions"],
      "libraries": ["-ldl"]
    }
  ]
}
