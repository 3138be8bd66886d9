"""benchmarks/step_breakdown.py reaches into the engine (the runner's model and sampler, the core's step, the
extension's op profile) to time a decode step by parts: this runs it on a tiny mixed-type file, so a change there
that breaks it shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.gguf_models import write_llama_gguf

ROOT = Path(__file__).resolve().parent.parent


def test_step_breakdown_times_a_decode_step_by_parts_and_the_projections_alone(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "tiny-q4_k_m.gguf", mix="Q4_K_M")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "step_breakdown.py"), str(path), "--batch", "2", "--tokens", "6"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    step = re.search(r"2 requests: ([\d.]+) ms a decode step", out)
    parts = {name: float(ms) for name, ms in re.findall(r"^  ([a-zA-Z][a-zA-Z ]*): ([\d.-]+) ms$", out, re.M)}
    ops = {name: float(ms) for name, ms in re.findall(r"^    ([a-z_/ ]+): ([\d.]+) ms \([\d.]+%\)$", out, re.M)}
    alone = re.search(r"the projections alone, 2 rows: ([\d.]+) ms \(([\d.]+) GB/s", out)
    read = re.search(r"after each pass: ([\d.]+) GB/s; the projections stream at (\d+)% of it", out)
    assert step and alone and read, out
    assert float(read.group(1)) > 0 and int(read.group(2)) > 0, out
    assert set(parts) == {"layer loop", "LM head", "sampling", "engine around them"}, out
    assert parts["layer loop"] > 0 and parts["LM head"] > 0 and float(alone.group(1)) > 0, out
    # the parts are within the step they were timed in
    assert parts["layer loop"] + parts["LM head"] + parts["sampling"] <= float(step.group(1)) + 0.05, out
    # the layer loop by op: a Llama's every op timed inside the loop, all within it
    assert set(ops) == {
        "input norm",
        "qkv",
        "rope",
        "kv store",
        "attention",
        "o",
        "mlp norm",
        "gate_up",
        "down",
        "final norm",
    }, out
    assert ops["attention"] > 0 and ops["gate_up"] > 0, out
    assert sum(ops.values()) <= parts["layer loop"] + 0.05, out
