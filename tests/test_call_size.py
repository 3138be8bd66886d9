"""benchmarks/call_size.py joins a file's projections into one packed linear and runs it whole and in pieces: this
runs it on a tiny mixed-type file, so a change to the packing or to block_linear that breaks it shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.gguf_models import write_llama_gguf

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "call_size.py"


def test_call_size_runs_the_projections_whole_and_in_pieces(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "tiny-q4_k_m.gguf", mix="Q4_K_M")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(path), "--rounds", "2"], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(
        r"^  (one call|[\d.]+ MB calls): (\d+) calls, ([\d.]+) GB/s, time / one call ([\d.]+)", done.stdout, re.M
    )
    assert [name for name, *_ in rows] == ["one call", "16 MB calls", "4 MB calls", "2 MB calls", "1 MB calls"], (
        done.stdout
    )
    assert all(int(calls) >= 1 and float(rate) > 0 for _, calls, rate, _ in rows), done.stdout
    assert re.search(r"kind 10\d, [\d.]+ MB of \d+-input projections, one row", done.stdout), done.stdout


def test_call_size_names_a_kind_the_file_lacks(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "tiny-q4_k_m.gguf", mix="Q4_K_M")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(path), "--rounds", "1", "--kind", "999"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode != 0 and "no " in done.stderr and "kind 999" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
