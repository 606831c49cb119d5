"""The facade pattern: a ``wait`` flag typed with ``@overload`` on ``Literal``.

``Counter`` below is the example facades copy. ``test_mypy_strict_accepts_the_overloads`` runs
``mypy --strict`` on this very file: every ``assert_type`` must hold, so the return type follows
the flag (``Literal[True]`` → ``int``, ``Literal[False]`` → ``TaskHandle[int]``).
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Literal, assert_type, overload

import anyio
import anyio.lowlevel
import pytest

from swarmavg.sync import TaskHandle, call

pytestmark = pytest.mark.timeout(10)


class Counter:
    """A tiny synchronous facade over async state that lives on the loop thread."""

    def __init__(self) -> None:
        self._value = 0

    async def _aincrement(self, by: int) -> int:
        await anyio.lowlevel.checkpoint()
        self._value += by
        return self._value

    @overload
    def increment(self, by: int = 1, *, wait: Literal[True] = True) -> int: ...

    @overload
    def increment(self, by: int = 1, *, wait: Literal[False]) -> TaskHandle[int]: ...

    @overload
    def increment(self, by: int = 1, *, wait: bool) -> int | TaskHandle[int]: ...

    def increment(self, by: int = 1, *, wait: bool = True) -> int | TaskHandle[int]:
        """Add ``by``; return the new value, or with ``wait=False`` a handle to it."""
        return call(self._aincrement, by, wait=wait)


def test_the_return_type_follows_the_wait_flag() -> None:
    counter = Counter()

    value = counter.increment(2)
    assert_type(value, int)
    assert value == 2

    handle = counter.increment(3, wait=False)
    assert_type(handle, TaskHandle[int])
    assert isinstance(handle, TaskHandle)
    assert handle.result(5) == 5

    explicit = counter.increment(wait=True)
    assert_type(explicit, int)
    assert explicit == 6

    def flag() -> bool:
        return False

    either = counter.increment(wait=flag())
    assert_type(either, int | TaskHandle[int])
    assert isinstance(either, TaskHandle)
    done, _ = concurrent.futures.wait([either], timeout=5)
    assert done == {either}


def test_call_directly() -> None:
    async def double(x: int) -> int:
        return 2 * x

    assert_type(call(double, 4), int)
    assert call(double, 4) == 8
    assert_type(call(double, 5, wait=False), TaskHandle[int])
    assert call(double, 5, wait=False).result(5) == 10


MISUSE = """
    from swarmavg.sync import TaskHandle, call
    from test_sync_facade import Counter

    async def double(x: int) -> int:
        return 2 * x

    value: int = Counter().increment(wait=False)  # E: a handle is not an int
    handle: TaskHandle[int] = Counter().increment()  # E: an int is not a handle
    call(double, "four")  # E: argument types are checked through call()
"""


@pytest.mark.process
@pytest.mark.timeout(120)
def test_mypy_strict_accepts_the_overloads(tmp_path: Path) -> None:
    """mypy --strict passes on this file and rejects the misuse in ``MISUSE``."""
    import mypy  # noqa: F401  (in the test extras: a missing mypy is a broken install)

    misuse = tmp_path / "misuse.py"
    misuse.write_text(textwrap.dedent(MISUSE))
    here = Path(__file__)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",  # judge these two files, not the rest of the tree
            "--no-error-summary",
            "--hide-error-context",
            str(here),
            str(misuse),
        ],
        capture_output=True,
        text=True,
        cwd=here.parents[2],
        env={**os.environ, "MYPYPATH": str(here.parent)},
        check=False,
    )
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    misuse_errors = [line for line in errors if line.split(":")[0].endswith("misuse.py")]
    assert len(errors) == len(misuse_errors), proc.stdout  # this file itself is clean
    expected = [i + 1 for i, text in enumerate(misuse.read_text().splitlines()) if "# E:" in text]
    assert sorted(int(line.split(":")[1]) for line in misuse_errors) == expected, proc.stdout
