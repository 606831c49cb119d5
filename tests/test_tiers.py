"""The suite's tiers and time budget (tests/tiers.py), on cases of their own run by pytest in
this process, with a limit of a quarter second instead of 2 s."""

from __future__ import annotations

import pytest

CONFTEST = """
from tiers import TierGuard

def pytest_configure(config):
    guard = TierGuard(config, limit_s=0.25, budget_s={"deterministic": 0.4})
    config.pluginmanager.register(guard, "swarmavg-tiers")
"""

CASES = """
import subprocess
import sys
import time

import pytest


def _python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def _compute(seconds):
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass


def test_unmarked_starts_an_interpreter():
    _python()


@pytest.mark.process
def test_marked_starts_an_interpreter():
    _python()


import forkserver

if forkserver._unavailable() is None:
    forkserver.server()  # (started here: the test below only forks)


def test_unmarked_forks_a_peer():
    with open("peer.py", "w") as script:  # (in pytester's folder: a short name to report)
        script.write("pass")
    forkserver.run([sys.executable, "peer.py"], check=True)


def test_unmarked_computes_too_long():
    _compute(0.3)


@pytest.mark.slow
def test_slow_computes_long():
    _compute(0.3)


def test_unmarked_waits_on_the_wall_clock():
    time.sleep(0.3)


@pytest.mark.realtime
def test_realtime_waits_on_the_wall_clock():
    time.sleep(0.3)


def test_quick():
    pass
"""


@pytest.mark.process  # (its cases start `python -c pass` and fork a peer: what is checked)
def test_tiers_fail_what_breaks_their_rules_and_the_budget(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_cases=CASES)
    pytester.makeini("[pytest]\nmarkers =\n    process: p\n    realtime: r\n    slow: s\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    outcomes = {
        report.nodeid.split("::")[-1]: report.outcome
        for report in result.reprec.getreports("pytest_runtest_logreport")
        if report.when == "call"
    }
    assert outcomes == {
        "test_unmarked_starts_an_interpreter": "failed",
        "test_marked_starts_an_interpreter": "passed",
        "test_unmarked_forks_a_peer": "failed",
        "test_unmarked_computes_too_long": "failed",
        "test_slow_computes_long": "passed",
        "test_unmarked_waits_on_the_wall_clock": "failed",
        "test_realtime_waits_on_the_wall_clock": "passed",
        "test_quick": "passed",
    }
    result.stdout.fnmatch_lines(
        [
            "*test_unmarked_starts_an_interpreter: it started an interpreter (*python -c pass)*",
            "*test_unmarked_forks_a_peer: it started an interpreter (*peer.py)*",
            "*test_unmarked_computes_too_long: an unmarked (deterministic) test may take 0.25 s*",
            "*time per tier*",
            "deterministic * 6 tests*",
            "realtime * 1 tests*",
            "process * 1 tests*",
            "BUDGET EXCEEDED: the deterministic tier took *, over its budget of 0 s*",
        ]
    )
    # a selection is not the whole suite: no budget (the tests' own limits still hold)
    selected = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-k", "quick or slow")
    assert selected.ret == pytest.ExitCode.OK
    assert "BUDGET EXCEEDED" not in selected.stdout.str()
    # under a tracer (coverage) the time limit and the budget are reported, not enforced; an
    # interpreter started out of its tier still fails
    pytester.makeconftest(
        CONFTEST.replace(
            'budget_s={"deterministic": 0.4}', 'budget_s={"deterministic": 0.4}, traced=True'
        )
    )
    traced = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    outcomes = {
        report.nodeid.split("::")[-1]: report.outcome
        for report in traced.reprec.getreports("pytest_runtest_logreport")
        if report.when == "call"
    }
    assert outcomes["test_unmarked_computes_too_long"] == "passed"
    assert outcomes["test_unmarked_waits_on_the_wall_clock"] == "passed"
    assert outcomes["test_unmarked_starts_an_interpreter"] == "failed"
    assert "BUDGET EXCEEDED" not in traced.stdout.str()
