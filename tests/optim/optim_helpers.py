"""What the optimizer tests share: a swarm of DHTs in this process, peers' loops as threads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

from swarmavg import DHT

#: Averager options that keep the tests fast.
FAST = {"request_timeout": 1.0}


@contextmanager
def swarm(count: int) -> Iterator[list[DHT]]:
    """``count`` DHTs on 127.0.0.1, the others bootstrapped from the first."""
    with ExitStack() as stack:
        first = stack.enter_context(DHT())
        dhts = [first]
        for _ in range(count - 1):
            dhts.append(stack.enter_context(DHT(first.get_visible_maddrs())))
        yield dhts


def run_threads(targets: list[Callable[[], None]], timeout: float = 90) -> None:
    """Run each peer's loop in a thread; fail if one hangs, raise the first error."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), "a peer's training loop hung"
    if errors:
        raise errors[0]
