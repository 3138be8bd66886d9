"""The TUI's own CPU while answers stream (issue 18's goal: <= 15% of one core at 3 streams).

The app runs headless (Textual's test driver: the same widgets, layout and compositor, output to
nowhere) on a fake engine that streams a Markdown answer at a steady rate per session, so what is
measured is the UI's work alone: the engine's CPU is not in this process. Reported: the app
process's CPU time over the streaming window as a share of one core, at 1 and 3 concurrent streams,
for each run and their median. Each run is a fresh process, as each start of ``chatapp`` is: runs
in one process measured the apps before them too (the memory they left grows every collection).

    python benchmarks/tui_cpu.py [--rate 30] [--seconds 10] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the fakes of tests/

from chatapp.engine.output_processor import OutputDelta
from chatapp.tui.app import ChatApp
from tests.tui_fakes import FakeCatalog, FakeClient, factory

ANSWER = (
    "Here is a **plan** for the week:\n\n"
    + "".join(
        f"- Day {i}: read chapter {i}, write a summary, and try the `exercise_{i}()` function.\n" for i in range(1, 8)
    )
    + "\n```python\n"
    + "".join(f"def exercise_{i}(x):\n    return x * {i}\n\n" for i in range(1, 8))
    + "```\n\nThat is all; ask again for more detail on any day. "
) * 8


class PacedClient(FakeClient):
    """Streams ANSWER at ``rate`` tokens a second (a token: ~4 characters), as a 1-8B model on a laptop."""

    rate: float = 30.0

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[OutputDelta]:
        rid = kwargs.get("request_id") or "paced"
        self.requests.append(kwargs)
        pieces = [ANSWER[i : i + 4] for i in range(0, len(ANSWER), 4)]
        start = time.monotonic()
        for n, piece in enumerate(pieces, 1):
            await asyncio.sleep(max(0.0, start + n / self.rate - time.monotonic()))
            yield OutputDelta(rid, piece, [n], None, False, None, None, 10, n, 0)
        yield OutputDelta(rid, "", [], None, True, "stop", None, 10, len(pieces), 0)


async def measure(streams: int, rate: float, seconds: float) -> float:
    """Share of one core this process used while ``streams`` answers streamed."""
    with tempfile.TemporaryDirectory() as tmp:
        client = PacedClient()
        client.rate = rate
        app = ChatApp(
            settings_path=Path(tmp) / "settings.toml",
            history_path=Path(tmp) / "history.sqlite3",
            engine_factory=factory(client),
            catalog=FakeCatalog(),
            session_sampling={"temperature": 0, "max_tokens": 4096},
        )
        async with app.run_test(size=(160, 45)) as pilot:
            for _ in range(streams - 1):
                await pilot.press("ctrl+t")
            await pilot.pause(0.5)
            screen = app.screen
            for pane in screen.panes:  # type: ignore[attr-defined]
                pane.prompt.text = "plan my week"
                await pane.send("plan my week")
            await asyncio.sleep(2.0)  # past the first screens' layout
            process = psutil.Process()
            before, t0 = process.cpu_times(), time.monotonic()
            await asyncio.sleep(seconds)
            after, t1 = process.cpu_times(), time.monotonic()
            for pane in screen.panes:  # type: ignore[attr-defined]
                pane.stop()
            await pilot.pause(0.2)
            await app.action_quit()
    used = (after.user - before.user) + (after.system - before.system)
    return used / (t1 - t0)


def run_fresh(streams: int, rate: float, seconds: float) -> float:
    """One measurement in a new process (see the module's docstring)."""
    command = [sys.executable, __file__, "--child", str(streams), "--rate", str(rate), "--seconds", str(seconds)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=30.0, help="tokens a second per stream")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the measured window")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", type=int, metavar="STREAMS", help=argparse.SUPPRESS)  # one run, printed
    args = parser.parse_args()
    if args.child:
        print(asyncio.run(measure(args.child, args.rate, args.seconds)), flush=True)
        return
    for streams in (1, 3):
        shares = [run_fresh(streams, args.rate, args.seconds) for _ in range(args.runs)]
        print(
            f"{streams} stream(s) at {args.rate:g} tok/s: TUI CPU "
            + " / ".join(f"{s:.1%}" for s in shares)
            + f" of one core, median {statistics.median(shares):.1%} (goal <= 15% at 3 streams)",
            flush=True,
        )


if __name__ == "__main__":
    main()
