"""The suite's own rule (``tests/conftest.py``): a test that logs at ERROR fails, unless it is
marked ``allow_error_log``. Checked by running a few tests under that conftest in a fresh
pytest process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CASES = """
import logging
import threading

import pytest


def test_quiet():
    logging.getLogger("swarmavg.x").warning("a warning is fine")


def test_logs_an_error():
    logging.getLogger("swarmavg.x").error("a bug: %s", "details")


def test_logs_from_another_thread():
    worker = threading.Thread(target=lambda: logging.getLogger("asyncio").error("in a thread"))
    worker.start()
    worker.join()


def test_logs_an_exception():
    try:
        raise KeyError("boom")
    except KeyError:
        logging.getLogger("elsewhere").exception("handled badly")


@pytest.mark.allow_error_log
def test_expects_an_error():
    logging.getLogger("swarmavg.x").error("the behaviour under test")
"""


@pytest.mark.process
def test_a_test_that_logs_an_error_fails_at_teardown(tmp_path: Path) -> None:
    conftest = Path(__file__).with_name("conftest.py").read_text()
    (tmp_path / "conftest.py").write_text(conftest)
    for helper in ("tiers.py", "forkserver.py"):  # (the conftest's plugin and what it closes)
        (tmp_path / helper).write_text(Path(__file__).with_name(helper).read_text())
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = --strict-markers\nmarkers =\n    allow_error_log: expected\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    out = run.stdout
    assert run.returncode == 1, out
    assert "5 passed, 3 errors" in out, out
    for name in ("test_logs_an_error", "test_logs_from_another_thread", "test_logs_an_exception"):
        assert f"ERROR test_cases.py::{name}" in out, out
    assert "ERROR swarmavg.x: a bug: details" in out
    assert "ERROR asyncio: in a thread" in out
    assert "ERROR elsewhere: handled badly [builtins.KeyError: 'boom']" in out
    assert "PASSED test_cases.py::test_expects_an_error" in out
    assert "ERROR test_cases.py::test_expects_an_error" not in out
    assert "ERROR test_cases.py::test_quiet" not in out
