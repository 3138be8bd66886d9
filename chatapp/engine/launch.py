"""The engine process's entry point (``python -m chatapp.engine.launch``, started by client.py): work that
can begin before the engine's own imports, then the engine (process.py).

Why: a GGUF file whose tokenizer transformers builds (the SentencePiece kinds: ~1.2 s on its first start)
used to have it built only after the weights had loaded; started here, in a process of its own, the build
runs on another core while this one imports the engine and loads the weights (tokenizer.py,
start_tokenizer_build; a byte-level BPE tokenizer is built by its first client instead).
A client may start this process before it knows the config (prestart.py): then the engine's imports
come first and the config arrives on stdin. This module imports nothing heavy before handing over
but numpy (see blas_threads.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

from chatapp.engine import blas_threads, prestart, startup_gc


def main(argv: list[str] | None = None) -> int:
    startup_gc.hold()  # released when the first model has loaded (process.py)
    blas_threads.import_numpy_with_one_blas_thread()
    argv = sys.argv[1:] if argv is None else argv
    if prestart.CONFIG_FROM_STDIN in argv:  # started ahead of its client (prestart.py)
        return _run_prestarted([a for a in argv if a != prestart.CONFIG_FROM_STDIN])
    _start_tokenizer_build(argv)
    from chatapp.engine.process import main as run_engine

    return run_engine(argv)


def _run_prestarted(argv: list[str]) -> int:
    """Import the engine first, then wait for the config on stdin; no config (the client attached to a
    running engine, or died) means there is nothing to do. While it waits, what every CPU load needs
    and no config changes is made ready: torch's C++ libraries, and the modules of the load path."""
    from chatapp.engine.process import main as run_engine

    _import_load_path()  # first: its extension modules would wait on the linker's lock (below) otherwise
    preload = _preload_torch_libraries()
    config = sys.stdin.buffer.read().decode()
    if not config.strip():
        if preload is not None:
            preload.join()
        return 0
    argv = ["--config", config, *argv]
    _start_tokenizer_build(argv)
    # The engine starts beside the preload: its loader's first dlopen of those libraries waits for it.
    return run_engine(argv)


def _preload_torch_libraries() -> threading.Thread | None:
    """Load torch's C++ libraries on a thread, where the C++ CPU kernels will run: not where a GPU may
    serve instead (that engine imports torch itself), nor when the kernels are turned off."""
    from chatapp.engine import cpu_kernels
    from chatapp.engine.config import no_gpu_here

    if os.environ.get("CHATAPP_NO_CPU_KERNELS") == "1" or not no_gpu_here():
        return None
    return cpu_kernels.load_torch_libraries_in_background()


def _import_load_path() -> None:
    """Import the modules a GGUF load on the CPU goes through (~50 ms), before its config comes."""
    import numpy.random  # noqa: F401  (array_sampler's draws; numpy imports it on first use)

    import chatapp.engine.array_runner  # noqa: F401
    import chatapp.engine.models.array_model  # noqa: F401
    import chatapp.engine.models.gguf_weights  # noqa: F401


def _start_tokenizer_build(argv: list[str]) -> None:
    """Start building the default model's tokenizer files when it is a GGUF file without them."""
    from chatapp.engine.model_ref import resolve_model_spec
    from chatapp.engine.tokenizer import start_tokenizer_build

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", default="{}")
    known, _ = parser.parse_known_args(argv)
    try:
        model = json.loads(known.config).get("model")
        start_tokenizer_build(resolve_model_spec(model).path)
    except Exception:  # a bad model or config is the engine's to report, as it loads it
        return


if __name__ == "__main__":
    sys.exit(main())
