"""The watch that prints a slow test's asyncio tasks before pytest-timeout ends it (hang_report.py)."""

from __future__ import annotations

import asyncio

import pytest

from tests import hang_report


@pytest.mark.timeout(8)  # the watch reports at half of it, 4 s in
async def test_a_test_near_its_timeout_has_its_waiting_tasks_printed(capsys: pytest.CaptureFixture[str]) -> None:
    async def waits_for_an_answer_that_never_comes() -> None:
        await asyncio.Event().wait()

    stuck = asyncio.create_task(waits_for_an_answer_that_never_comes(), name="the-stuck-call")
    before = hang_report.reports
    while hang_report.reports == before:  # (a watch that never reports leaves this to the timeout: a failure)
        await asyncio.sleep(0.1)
    stuck.cancel()
    err = capsys.readouterr().err
    assert "test_a_test_near_its_timeout_has_its_waiting_tasks_printed" in err
    assert "the-stuck-call" in err and "waits_for_an_answer_that_never_comes" in err


def test_the_limit_comes_from_the_marker_or_the_ini_option(request: pytest.FixtureRequest) -> None:
    assert hang_report.timeout_of(request.node) == float(request.config.getini("timeout"))
