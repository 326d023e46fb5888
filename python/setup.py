"""The optional C part: the allocation functions PyTorch's pluggable allocator
loads (vmmd.torch). Everything else is in pyproject.toml. Without a compiler
the build goes on without it, and vmmd.torch builds it on first use."""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "vmmd._torch_allocator",
            ["src/vmmd/_torch_allocator.c"],
            define_macros=[("VMMD_PYTHON_MODULE", "1")],
            optional=True,
        )
    ]
)
