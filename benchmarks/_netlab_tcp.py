"""One host of ``benchmarks/network.py``'s raw TCP reference, started inside a network-lab host.

What TCP itself achieves on the lab's links with an all-reduce's traffic and nothing else: each
host holds one TCP connection to every other host (made once, as gloo's are) and, in a round,
sends ``--bytes`` on each and receives as much from each, all at once (one thread per
direction and connection: no computation, no dependencies between the flows). With ``--bytes``
``2 S / N``, a host sends and receives ``2 (N-1) / N * S``, what a butterfly all-reduce of
``S`` bytes moves, spread as evenly over the connections.

Driven by JSON lines on stdin, each answered by one on stdout:

- ``{"op": "connect"}``: listen on ``--port``, connect to the higher ranks, accept the lower
  ones; ``{"event": "connected"}`` once every connection is up;
- ``{"op": "go", "at": T}``: at ``T`` (``time.time()``: the lab's hosts share the machine's
  clock), exchange; ``{"event": "done", "t": seconds from T to this host's last byte sent
  and received}``;
- ``{"op": "exit"}``.

A failure is answered ``{"event": ..., "error": "..."}`` and ends the process. stdlib only;
exits when stdin closes too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import threading
import time

CHUNK = 1 << 20


def _connect(rank: int, addresses: list[str], port: int, timeout: float) -> list[socket.socket]:
    listener = socket.create_server((addresses[rank], port), backlog=len(addresses))
    listener.settimeout(timeout)
    accepted: list[socket.socket] = []
    errors: list[BaseException] = []

    def accept() -> None:
        try:
            for _ in range(rank):
                conn, _ = listener.accept()
                conn.settimeout(None)
                accepted.append(conn)
        except OSError as exc:
            errors.append(exc)

    thread = threading.Thread(target=accept)
    thread.start()
    connections = []
    deadline = time.monotonic() + timeout
    for other in range(rank + 1, len(addresses)):
        while True:
            try:
                conn = socket.create_connection((addresses[other], port), timeout=timeout)
                break
            except OSError:  # (not listening yet)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        conn.settimeout(None)
        connections.append(conn)
    thread.join()
    listener.close()
    if errors:
        raise errors[0]
    return connections + accepted


def _exchange(connections: list[socket.socket], nbytes: int, start: float) -> float:
    payload = memoryview(bytes(CHUNK))
    failures: list[BaseException] = []

    def fail(exc: BaseException) -> None:
        # (every flow ends at once, here and, as the connections close, at the other
        # hosts: no thread waits for bytes that will not come)
        failures.append(exc)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def send(conn: socket.socket) -> None:
        try:
            left = nbytes
            while left > 0:
                count = min(left, CHUNK)
                conn.sendall(payload[:count])
                left -= count
        except OSError as exc:
            fail(exc)

    def receive(conn: socket.socket) -> None:
        scratch = memoryview(bytearray(CHUNK))
        try:
            left = nbytes
            while left > 0:
                count = conn.recv_into(scratch, min(left, CHUNK))
                if not count:
                    raise ConnectionError("the peer closed the connection")
                left -= count
        except OSError as exc:
            fail(exc)

    threads = [
        threading.Thread(target=work, args=(conn,))
        for conn in connections
        for work in (send, receive)
    ]
    time.sleep(max(0.0, start - time.time()))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return time.time() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--addresses", required=True, help="every host's address, in rank order")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bytes", type=int, required=True, help="sent on each connection")
    parser.add_argument("--timeout", type=float, default=60.0, help="to connect (s)")
    args = parser.parse_args()
    addresses = args.addresses.split(",")
    connections: list[socket.socket] = []
    try:
        for line in sys.stdin:
            request = json.loads(line)
            op = request.get("op")
            answer: dict[str, object] = {"event": "connected" if op == "connect" else "done"}
            try:
                if op == "connect":
                    connections = _connect(args.rank, addresses, args.port, args.timeout)
                elif op == "go":
                    answer["t"] = _exchange(connections, args.bytes, float(request["at"]))
                elif op == "exit":
                    break
                else:
                    raise ValueError(f"unknown op {op!r}")
            except (OSError, ValueError, KeyError) as exc:
                answer["error"] = f"{type(exc).__name__}: {exc}"
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
            if "error" in answer:
                return 1
    finally:
        for conn in connections:
            conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
