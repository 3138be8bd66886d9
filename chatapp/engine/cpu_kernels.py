"""Our C++ CPU code: paged attention, block-quantized linear layers and the layer loop.

Built at install time (setup.py, kernel_build.py) for this machine; when that build is missing or
was made for another CPU, source or torch, it is compiled on first use into the cache directory
(a minute or two, said in the log and the loading status). They are optional: where no compiler is
available (or CHATAPP_NO_CPU_KERNELS=1 is set) the engine runs its torch path, which computes the
same results more slowly.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import logging
import os
import sys
import threading
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from chatapp.engine import kernel_build

log = logging.getLogger(__name__)

PREBUILT_DIR = Path(__file__).parent
"""Where `pip install` puts its build (kernel_build.build_into)."""


@lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """The compiled extension, or None (said once, with why) when it cannot be built here."""
    if os.environ.get("CHATAPP_NO_CPU_KERNELS") == "1":
        return None
    try:
        key = kernel_build.build_key(kernel_build.torch_version())
        prebuilt = _prebuilt(key)
        if prebuilt is not None:
            return prebuilt
        name = f"chatapp_cpu_kernels_{key}"
        build_dir = _cache_build_dir(key)
        built = build_dir / f"{name}.so"
        if built.exists():  # the key covers source, flags, CPU and torch: import it without asking ninja
            try:
                return _import_built(name, built)
            except (ImportError, OSError) as exc:  # e.g. a link cut short: build it again
                log.info("rebuilding the CPU kernels (%s)", exc)
        log.info("compiling chatapp's C++ CPU kernels for this machine (once; about a minute or two)")
        return kernel_build.compile_extension(name, build_dir)
    except Exception as exc:  # no compiler, no headers, a sandbox: the torch path still works
        log.warning(
            "chatapp's C++ CPU kernels could not be built (%s); running on the slower torch path",
            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
        )
        return None


def release_idle_activations() -> int:
    """Free the C++ activation pool's idle blocks (memory.py says when); the bytes they held. Nothing where
    this process never loaded the extension (an engine on a GPU, or with the kernels off)."""
    if load.cache_info().currsize == 0:
        return 0
    module = load()
    return 0 if module is None else int(module.release_idle_activations())


def load_torch_libraries_in_background() -> threading.Thread:
    """Start loading torch's C++ libraries (what load() needs first) on a thread, and return it.

    Why: that is ~0.17 s of CPU, almost all of it libtorch_cpu's static initializers. An engine started
    ahead of its client (launch.py) does it while it reads its config and the model file's header. It calls
    the C library's dlopen through ctypes, which lets go of the interpreter's lock for the call (Python 3.11's
    ctypes.CDLL holds it, and the interpreter would stand still for those 0.17 s). The linker holds its own
    lock meanwhile: an extension module imported on another thread waits for it. A failure is left for
    load() to meet and report.
    """

    def run() -> None:
        with contextlib.suppress(Exception):
            lib = _torch_library_dir()
            for name in _TORCH_LIBRARIES_WITHOUT_PYTHON:
                _dlopen_releasing_the_interpreter(lib / name)

    thread = threading.Thread(target=run, name="torch-libraries-preload", daemon=True)
    thread.start()
    return thread


def _dlopen_releasing_the_interpreter(path: Path) -> None:
    """dlopen(path, RTLD_LAZY | RTLD_GLOBAL) as a foreign call, so other threads run Python meanwhile.
    The handle is kept open for the process's life: _load_torch_libraries then finds the library loaded.

    RTLD_LAZY: each of libtorch's calls into another library is bound when first made, not all of them at
    load (RTLD_NOW, ctypes' own mode): ~10 ms less CPU in every CPU start (alternated first starts, 1B
    Q4_K_M: median 0.648 -> 0.638 s). A symbol missing from torch's own libraries is not a case to meet."""
    libc = ctypes.CDLL(None)
    dlopen = libc.dlopen
    dlopen.restype, dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
    if not dlopen(os.fsencode(path), os.RTLD_LAZY | os.RTLD_GLOBAL):
        raise OSError(f"cannot load {path}")


def _prebuilt(key: str) -> ModuleType | None:
    """The install-time build, if it was made for this source, CPU and torch."""
    so = PREBUILT_DIR / f"{kernel_build.PREBUILT_NAME}.so"
    meta = PREBUILT_DIR / f"{kernel_build.PREBUILT_NAME}.json"
    try:
        if json.loads(meta.read_text()).get("key") != key:
            log.info("the CPU kernels built at install are for another CPU, source or torch; not used")
            return None
        return _import_built(kernel_build.PREBUILT_NAME, so)
    except (OSError, ValueError, ImportError):
        return None


def source() -> str:
    """Where the loaded extension came from: "install", "cache" (compiled on first use) or "none"."""
    module = load()
    if module is None:
        return "none"
    return "install" if module.__name__ == kernel_build.PREBUILT_NAME else "cache"


def _cache_build_dir(key: str) -> Path:
    from chatapp import paths

    return paths.cache_dir() / "torch_extensions" / f"cpu_kernels_{key}"


# What the extension links against, in load order (libtorch_python only for the torch-tensor arguments
# of the torch path; loading it does not start torch's Python module).
_TORCH_LIBRARIES = ("libc10.so", "libtorch_cpu.so", "libtorch_python.so")
# What the background preload loads: libtorch_python is 6 ms, and its initializers may take the
# interpreter's lock, which a preload running beside the interpreter must not wait for.
_TORCH_LIBRARIES_WITHOUT_PYTHON = _TORCH_LIBRARIES[:2]


def _torch_library_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise ImportError("torch is not installed")
    return Path(spec.origin).parent / "lib"


def _load_torch_libraries() -> None:
    """Load torch's C++ libraries, not its Python module: the torch-free CPU path (array_runner.py)
    calls the extension with numpy arrays, and `import torch` would cost ~1.1 s of the engine's start."""
    if "torch" in sys.modules:
        return
    lib = _torch_library_dir()
    for name in _TORCH_LIBRARIES:
        ctypes.CDLL(str(lib / name), mode=os.RTLD_GLOBAL)


def _import_built(name: str, path: Path) -> ModuleType:
    _load_torch_libraries()
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
