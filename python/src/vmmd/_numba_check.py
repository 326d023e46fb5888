"""vmmd.numba needs numba-cuda (NVIDIA's CUDA target for Numba, `import
numba.cuda` served by the numba_cuda package), not the numba.cuda built into
Numba: its memory-manager plug-in and the internals vmmd.numba patches are
numba-cuda's. Numba itself would say only "Failed to use memory manager from
vmmd.numba"."""
from __future__ import annotations

import importlib.metadata
import os
import warnings

# The numba-cuda minors vmmd.numba was tested with (pyproject.toml's `numba` extra says the same).
TESTED = ((0, 30), (0, 31))


def require_numba_cuda() -> None:
    """Raises ImportError, naming the fix, when numba.cuda is Numba's built-in
    target; warns when numba-cuda is newer or older than the tested minors."""
    import numba.cuda

    parts = os.path.normpath(getattr(numba.cuda, "__file__", None) or "").split(os.sep)
    if "numba_cuda" not in parts:
        raise ImportError(
            "vmmd.numba needs numba-cuda, and numba.cuda here is the CUDA target built into Numba "
            f"({getattr(numba.cuda, '__file__', 'numba.cuda')}): pip install numba-cuda "
            '(or: pip install "vmmd[numba]"), then run again with NUMBA_CUDA_MEMORY_MANAGER=vmmd.numba'
        )
    try:
        version = importlib.metadata.version("numba-cuda")
    except importlib.metadata.PackageNotFoundError:
        return
    minor = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if not TESTED[0] <= minor < TESTED[1]:
        warnings.warn(f"vmmd.numba was tested with numba-cuda {TESTED[0][0]}.{TESTED[0][1]}.x; this is {version}", RuntimeWarning, stacklevel=2)


# Importing this module is the check (vmmd.numba imports it before numba.cuda's names).
require_numba_cuda()
