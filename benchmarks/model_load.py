"""How long the engine takes to load a GGUF file's weights, and what loading holds in memory.

Run: python benchmarks/model_load.py [FILE.gguf] [--repeat N]   (default: the bundled model)

Each measurement opens the file and loads its weights (`load_gguf_native`, the CPU path) in a
fresh Python process, after the imports and the kernels' load: the figures are the loader's own
work. The first run may read the file from disk; later ones find it in the page cache. There is
no conversion any more: earlier versions converted a GGUF file to float32 safetensors first
(18.2 s for the bundled model, then 0.1 s from that cache).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = """
import json, sys, time
import psutil
from chatapp.engine import cpu_kernels
from chatapp.engine.models.gguf_file import GGUFModelFile
from chatapp.engine.models.gguf_loader import load_gguf_native
ext = cpu_kernels.load()
before = psutil.Process().memory_info().rss
start = time.perf_counter()
gguf = GGUFModelFile(sys.argv[1])
model = load_gguf_native(gguf, gguf.model_config(), 4096, ext)
seconds = time.perf_counter() - start
# VmHWM, not ru_maxrss: that keeps the parent's peak across exec
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "peak_over_before": peak - before}))
"""


def _timed_load(path: str) -> dict:
    result = subprocess.run([sys.executable, "-c", _CHILD, path], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"loading failed:\n{result.stderr.strip()}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", help="a GGUF file (default: the bundled model)")
    parser.add_argument("--repeat", type=int, default=3, help="loads to time (the best one is reported)")
    args = parser.parse_args()
    if args.file is None:
        from chatapp.store import bundled_gguf_path

        args.file = str(bundled_gguf_path())
    from pathlib import Path

    size = Path(args.file).stat().st_size
    runs = [_timed_load(args.file) for _ in range(max(args.repeat, 1))]
    best = min(runs, key=lambda r: r["seconds"])
    print(
        f"{Path(args.file).name} ({size / 2**20:.0f} MiB): load {best['seconds']:.2f} s (best of {len(runs)}), "
        f"peak RSS over the process before it {best['peak_over_before'] / 2**20:.0f} MiB "
        f"= {best['peak_over_before'] / size:.2f}x the file"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
