"""What a newcomer's install must do, run by ``nox -s install`` in a fresh venv into which a
fresh clone was installed with ``pip install <clone>`` or ``pip install -e <clone>`` alone
(no extras): a TCP swarm works, the QUIC transport says which extra it needs, and the package
that runs is the installed one.

Usage: ``python tests/install_check.py CLONE`` from a directory outside any checkout.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path


def main(clone: Path) -> None:
    import torch

    import swarmavg

    where = Path(swarmavg.__file__).resolve()
    print(f"swarmavg {swarmavg.__version__} from {where}")
    assert where.is_relative_to(clone.resolve()) or where.is_relative_to(Path(sys.prefix)), where
    assert (where.parent / "py.typed").is_file(), "py.typed missing: type checkers ignore us"

    names = swarmavg.available_transports()
    assert {"memory", "tcp", "quic"} <= set(names), names
    tcp = swarmavg.resolve_transport("tcp")
    print(f"transports: {', '.join(names)}; tcp is {tcp.__module__}.{tcp.__qualname__}")
    if importlib.util.find_spec("aioquic") is None:  # (the extra is not installed)
        try:
            swarmavg.resolve_transport("quic")
        except swarmavg.TransportNotFound as exc:
            message = str(exc)
            print("quic without its extra:", message)
            assert 'pip install "swarmavg[quic]"' in message, message
        else:
            raise AssertionError("quic resolved without aioquic")
    else:
        swarmavg.resolve_transport("quic")

    first = swarmavg.DHT(host="127.0.0.1")
    second = swarmavg.DHT(initial_peers=first.get_visible_maddrs(), host="127.0.0.1")
    tensors = [torch.full((1000,), 1.0), torch.full((1000,), 3.0)]
    averagers = [
        swarmavg.DecentralizedAverager([tensor], dht, prefix="install-check", target_group_size=2)
        for tensor, dht in zip(tensors, (first, second), strict=True)
    ]
    results: list[object] = [None, None]

    def step(i: int) -> None:
        results[i] = averagers[i].step(timeout=30)

    threads = [threading.Thread(target=step, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for averager in averagers:
        averager.shutdown()
    second.shutdown()
    first.shutdown()
    assert all(results), f"a step did not finish: {results}"
    for tensor in tensors:
        assert torch.equal(tensor, torch.full((1000,), 2.0)), tensor[:4]
    print(f"two peers averaged over TCP: {results[0]!r:.160}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
