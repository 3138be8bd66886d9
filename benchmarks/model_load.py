"""How long it takes to get the bundled model ready to load: first time (GGUF conversion) vs cached.

Run: python benchmarks/model_load.py [--repeat N]

Each measurement runs `resolve_model(None)` in a fresh Python process with
no network (HF_HUB_OFFLINE=1) and a chatapp cache directory that starts
empty, so the first run converts the GGUF file to safetensors and the later
ones find the conversion. Only the resolve call is timed (not interpreter
start-up or imports), so the figures compare the store's own work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = """
import json, time
from chatapp.store import resolve_model
start = time.perf_counter()
model = resolve_model(None)
print(json.dumps({"seconds": time.perf_counter() - start, "path": str(model.path)}))
"""


def _timed_resolve(env: dict[str, str]) -> dict:
    result = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"resolve_model failed:\n{result.stderr.strip()}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="cached loads to time (the best one is reported)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="chatapp-bench-") as cache:
        env = {**os.environ, "CHATAPP_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1"}
        first = _timed_resolve(env)
        cached = [_timed_resolve(env) for _ in range(max(args.repeat, 1))]
    best = min(r["seconds"] for r in cached)
    assert all(r["path"] == first["path"] for r in cached), "the cached load found another directory"
    print(f"first load (GGUF -> safetensors conversion): {first['seconds']:.2f} s")
    print(f"second load (cached conversion, best of {len(cached)}): {best:.3f} s")
    print(f"ratio: {first['seconds'] / best:.0f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
