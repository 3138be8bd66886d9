"""The GPU executor's own tests: collected only where torch sees a CUDA GPU.

CI runs on CPU machines, where this folder is not collected at all (rather than reported as
skipped): these tests are run by hand on a lent GPU machine, and their results are recorded in
the issue that asked for them. tests/test_kernels.py runs on either kind of machine.
"""

from __future__ import annotations

import torch

if not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]
