"""Our C++ CPU code, compiled on first use and cached: paged attention, block-quantized
linear layers and the layer loop.

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

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in
            ("paged_attention_cpu.cpp", "block_quant.cpp", "kquant.cpp", "gguf_repack.cpp", "cpu_forward.cpp")]
# -ffp-contract=off: no fused multiply-adds, so vectorised and scalar loops round alike
# (the kernel's results must not depend on how rows are tiled).
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]


@lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """The compiled extension, or None (logged once) when it cannot be built here."""
    if os.environ.get("CHATAPP_NO_CPU_KERNELS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        from chatapp import paths

        # Built with -march=native: key the build on the source, the flags and this machine's CPU.
        cpu = platform.processor() + _cpu_flags()
        key = "".join(p.read_text() for p in sorted(_CSRC.iterdir())) + " ".join(_CFLAGS) + cpu
        tag = hashlib.blake2b(key.encode(), digest_size=6).hexdigest()
        build_dir = paths.cache_dir() / "torch_extensions" / f"cpu_kernels_{tag}"
        built = build_dir / f"chatapp_cpu_kernels_{tag}.so"
        if built.exists():  # the key covers source, flags and CPU: import it without asking ninja (~1 s)
            try:
                return _import_built(f"chatapp_cpu_kernels_{tag}", built)
            except (ImportError, OSError) as exc:  # e.g. a link cut short: build it again
                log.info("rebuilding the CPU kernels (%s)", exc)
        build_dir.mkdir(parents=True, exist_ok=True)
        return load_extension(
            name=f"chatapp_cpu_kernels_{tag}",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers, a sandbox: the torch path still works
        log.warning("CPU attention kernels unavailable (%s); using the torch path", exc)
        return None


def _import_built(name: str, path: Path) -> ModuleType:
    import importlib.util

    import torch  # noqa: F401  the extension links against torch's libraries, loaded first

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
