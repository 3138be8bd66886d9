"""Builds chatapp's C++ CPU kernels while pip installs it (metadata lives in pyproject.toml).

The extension links against torch, so it is compiled with the torch of the environment being
installed into (the README installs torch first). pip's isolated build environment hides that
torch, so the build runs as `python -I chatapp/engine/kernel_build.py`: the same interpreter,
its own site-packages. With no torch or no compiler, the install still succeeds and says so; the
kernels are then compiled on first use (or the torch path runs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if os.environ.get("CHATAPP_NO_CPU_KERNELS") == "1":
            return
        editable = getattr(self, "editable_mode", False)
        target = (ROOT if editable else Path(self.build_lib)) / "chatapp" / "engine"
        script = ROOT / "chatapp" / "engine" / "kernel_build.py"
        result = subprocess.run([sys.executable, "-I", str(script), str(target)], capture_output=True, text=True)
        if result.returncode == 0:
            print(result.stdout.strip(), file=sys.stderr)
        else:
            why = (result.stderr.strip().splitlines() or ["unknown error"])[-1]
            print(
                f"chatapp: the C++ CPU kernels were not built at install ({why}); they will be compiled "
                "on first use, or the slower torch path runs",
                file=sys.stderr,
            )


setup(cmdclass={"build_py": BuildPyWithKernels})
