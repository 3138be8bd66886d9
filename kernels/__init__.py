"""Triton kernels for the GPU executor (installed as ``chatapp.kernels``).

Interpreter mode: Triton compiles kernels only for a GPU. On a machine
without one (no CUDA/ROCm device visible to torch) importing this package sets
``TRITON_INTERPRET=1`` (``os.environ.setdefault``, so an explicit setting wins)
*before* any ``@triton.jit`` function below is defined, because Triton decides
at decoration time whether a kernel is compiled or interpreted. Interpreted
kernels run on the CPU with numpy, take CPU tensors and are slow: they exist so
the kernels can be tested in CI without a GPU, not to serve requests.

Submodules import this package first, so the environment variable is in place
however the kernels are reached.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .attention import TilePlan, decode_plan, paged_attention, plan_tiles  # noqa: E402
from .cache_store import store_kv  # noqa: E402

__all__ = ["TilePlan", "decode_plan", "paged_attention", "plan_tiles", "store_kv"]
