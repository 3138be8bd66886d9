"""Our C++ CPU kernels, compiled on first use and cached.

They are optional: where no compiler is available (or CHATAPP_NO_CPU_KERNELS=1
is set) the torch backend falls back to its pure-torch path, which computes
the same results a little more slowly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import lru_cache
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


@lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """The compiled extension, or None (logged once) when it cannot be built here."""
    if os.environ.get("CHATAPP_NO_CPU_KERNELS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        from chatapp import paths

        # Built with -march=native: key the build on the source and this machine's CPU.
        cpu = platform.processor() + _cpu_flags()
        tag = hashlib.blake2b((_SOURCE.read_text() + cpu).encode(), digest_size=6).hexdigest()
        build_dir = paths.cache_dir() / "torch_extensions" / f"cpu_kernels_{tag}"
        build_dir.mkdir(parents=True, exist_ok=True)
        return load_extension(
            name=f"chatapp_cpu_kernels_{tag}",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers, a sandbox: the torch path still works
        log.warning("CPU attention kernels unavailable (%s); using the torch path", exc)
        return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
