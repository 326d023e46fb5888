"""torch.from_file(FILE).cuda() in one process, for bench/sections/store-load.ts.

Usage: torch_load.py FILE BYTES. Prints one JSON line: {"seconds": from_file and
.cuda() together, "cudaSeconds": .cuda() alone}. The CUDA context is made first,
outside the timing, as vmmctl's is outside its own seconds.
"""
import json
import sys
import time

import torch


def main() -> None:
    path, size = sys.argv[1], int(sys.argv[2])
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    host = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    middle = time.perf_counter()
    device = host.cuda()
    torch.cuda.synchronize()
    end = time.perf_counter()
    assert device.numel() == size
    print(json.dumps({"seconds": end - start, "cudaSeconds": end - middle}))


if __name__ == "__main__":
    main()
