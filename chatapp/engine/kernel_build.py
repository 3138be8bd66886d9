"""Compiling our C++ CPU kernels (csrc/): what is built, with which flags, and the key naming a build.

Two callers: `pip install` (setup.py runs this file as a script, with the installing environment's
torch, so the first `chatapp` starts at once) and cpu_kernels.load() at run time, which uses that
build when its key matches this machine, source and torch, and otherwise compiles one into the
cache directory. Standard library only at import: setup.py runs it by path, before chatapp is
installed, under `python -I` (pip's isolated build environment hides the installed torch).

    python chatapp/engine/kernel_build.py TARGET_DIR
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    "paged_attention_cpu.cpp",
    "block_quant.cpp",
    "kquant.cpp",
    "float_rows.cpp",
    "gguf_repack.cpp",
    "cpu_forward.cpp",
    "activation_pool.cpp",
)
# -march=native: the machine's own vector units (AVX-512 VNNI where it has them); the key below
# holds the CPU's flags, so a build never runs on a CPU it was not made for.
# -ffp-contract=off: no fused multiply-adds, so vectorised and scalar loops round alike
# (the kernel's results must not depend on how rows are tiled).
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
AVX2_MARCH = "haswell"
"""The oldest CPU our AVX2 loops run on; tests build for it to run the code a laptop without AVX-512 gets."""
LDFLAGS = ("-fopenmp",)
PREBUILT_NAME = "chatapp_cpu_kernels_prebuilt"
"""The module (and file) name of the build made at install time, beside this file."""


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def torch_version() -> str:
    """The installed torch's version, read without importing torch (~1.1 s, which the engine's torch-free
    CPU path saves): from torch/version.py, else from its package metadata (importing importlib.metadata
    alone is ~25 ms of the start)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin is not None:
        try:
            text = (Path(spec.origin).parent / "version.py").read_text()
        except OSError:
            text = ""
        match = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", text, re.MULTILINE)
        if match:
            return match.group(1)
    import importlib.metadata

    return importlib.metadata.version("torch")


def build_key(torch_release: str) -> str:
    """Source, flags, this CPU and the torch the extension links against, hashed."""
    parts = [(CSRC / name).read_text() for name in sorted(p.name for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))]
    parts += [" ".join(CFLAGS), platform.processor(), cpu_flags(), torch_release]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=6).hexdigest()


def compile_extension(name: str, build_dir: Path, march: str = "native") -> ModuleType:
    """Compile and import the extension as module ``name`` (ninja, through torch's cpp_extension).

    march: the CPU to build for; another than "native" is for tests (a build for an older CPU).
    """
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    module: ModuleType = load(
        name=name,
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=[f"-march={march}" if flag == "-march=native" else flag for flag in CFLAGS],
        extra_ldflags=list(LDFLAGS),
        build_directory=str(build_dir),
        verbose=False,
    )
    return module


def build_into(target: Path) -> Path:
    """Build the extension and place it, with its key, in ``target`` (the installed chatapp/engine)."""
    with tempfile.TemporaryDirectory(prefix="chatapp-kernels-") as tmp:
        module = compile_extension(PREBUILT_NAME, Path(tmp))
        assert module.__file__ is not None  # an extension module is loaded from its .so file
        built = Path(module.__file__)
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target / f"{PREBUILT_NAME}.so")
    (target / f"{PREBUILT_NAME}.json").write_text(
        json.dumps({"key": build_key(torch_version()), "torch": torch_version()})
    )
    return target / f"{PREBUILT_NAME}.so"


if __name__ == "__main__":
    print(f"chatapp: built the C++ CPU kernels: {build_into(Path(sys.argv[1]))}")
