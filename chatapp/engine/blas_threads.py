"""Import numpy with its OpenBLAS held to one thread, unless the user set a count or imported numpy already.

Why: numpy's OpenBLAS threads are not the engine's. Our C++ kernels run on their own workers, and OpenBLAS's
spin between its calls: ~9% of a model load's two cores in the engine process, and 1.5-2% of a 512-token
prompt's time through `LLM` in a user's process (alternated, 3 runs each: 572-574 against 579-585 tok/s on a
1B Q4_0 file). The setting is taken away again once numpy has read it, so that a torch built with OpenBLAS
(aarch64 wheels) keeps its threads.

Standard library only: the engine process calls this first (launch.py), and `chatapp.engine.LLM`'s first use
(__init__.py) before it imports the engine.
"""

from __future__ import annotations

import os
import sys


def import_numpy_with_one_blas_thread() -> None:
    if "OPENBLAS_NUM_THREADS" in os.environ or "numpy" in sys.modules:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        del os.environ["OPENBLAS_NUM_THREADS"]
