"""moolib's ``Accumulator`` example loop, run by ``swarmavg.Accumulator``: a cohort of peers
trains the byte-level language model of ``swarmavg.testing.workload`` (see
``docs/guides/accumulator.md`` and ``docs/guides/workload.md``).

Three peers on this machine, in three processes (this one starts them and prints their lines)::

    python examples/accumulator.py --peers 3                # until Ctrl+C
    python examples/accumulator.py --peers 3 --rounds 60    # stop at model version 60

or one process per peer, e.g. in three terminals (the first prints the address to give the
others; ``--peer-index`` picks each peer's own stream of batches)::

    python examples/accumulator.py
    python examples/accumulator.py --peer-index 1 --initial-peers ADDRESS
    python examples/accumulator.py --peer-index 2 --initial-peers ADDRESS

(``ADDRESS`` as the first one prints it: ``/ip4/127.0.0.1/tcp/PORT/p2p/12D3Koo...``)

The loop is the reference's (``moolib.Accumulator``'s docstring) line for line; what differs:

- the construction lines: a ``swarmavg.DHT`` for ``moolib.Rpc()``, ``swarmavg.Group(name, dht)``
  for ``moolib.Group(peer, name)``, and ``connect()`` takes any member's address (there is no
  broker);
- ``X``, ``y`` and ``loss`` come from the workload (each peer draws its own batches);
- before the loop, each peer waits until ``--wait-for`` members are in the cohort (``--peers N``
  passes N), so that they start together; without it the first peer would train alone until
  the others join (which works too: they then download its state);
- after ``zero_gradients()``, a line every ``--report-every`` results (the validation loss, the
  gradient stats, the leader), and the loop ends at model version ``--rounds`` or on Ctrl+C
  (SIGINT), after which the peer goes on serving the cohort for ``--linger`` seconds (so that
  one that stops first does not cut the others' last round short), leaves, prints
  ``final: version V, loss A -> B, params sha256 H`` and exits 0.

Every peer starts from its own random initialisation (``make_model(seed=peer index)``): at the
first election they all load the leader's model, so they end with equal parameters. With
``--peers N`` this process relays the peers' lines (``[peer i] ...``), ends them with SIGINT on
Ctrl+C, checks that they all ended at the same version with the same parameters, and exits 0
when they did (1 otherwise).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

FINAL = re.compile(r"final: version (\d+), loss ([\d.]+) -> ([\d.]+), params sha256 ([0-9a-f]+)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=0, help="start this many peer processes")
    parser.add_argument("--initial-peers", default=None, help="a member's address to join")
    parser.add_argument("--peer-index", type=int, default=0, help="this peer's batches, seed")
    parser.add_argument("--rounds", type=int, default=0, help="stop at this model version")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--virtual-batch-size", type=int, default=1)
    parser.add_argument("--wait-for", type=int, default=1, help="cohort members to wait for")
    parser.add_argument("--report-every", type=int, default=10)
    parser.add_argument("--linger", type=float, default=2.0)
    parser.add_argument("--max-seconds", type=float, default=0.0, help="stop after (0: never)")
    args = parser.parse_args(argv)
    for name in ("peers", "peer_index", "rounds", "max_seconds", "linger"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("batch_size", "virtual_batch_size", "wait_for", "report_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def params_digest(model: Any) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def peer(args: argparse.Namespace) -> int:
    """One peer: moolib's loop on the workload until ``--rounds``, ``--max-seconds`` or SIGINT."""
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())  # (the loop ends at its next turn)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    import swarmavg
    from swarmavg.testing import workload

    torch.set_num_threads(1)
    corpus = workload.load_corpus()
    data = workload.batches(corpus, args.batch_size, seed=args.peer_index)  # (its own stream)
    batch_size = args.batch_size

    # -- the construction lines (moolib's, with swarmavg's names) ------------------------------
    model = workload.make_model(seed=args.peer_index)
    dht = swarmavg.DHT()  # moolib.Rpc()
    group = swarmavg.Group("foo_group", dht)  # moolib.Group(peer, "foo_group")
    accumulator = swarmavg.Accumulator(
        "bar",
        model.parameters(),
        model.buffers(),
        group=group,
        virtual_batch_size=args.virtual_batch_size,
    )
    if args.initial_peers:
        accumulator.connect(args.initial_peers)  # any member's address (no broker)
    print(f"address: {dht.get_visible_maddrs()[0]}", flush=True)

    opt = torch.optim.Adam(model.parameters(), lr=workload.DEFAULT_LR)

    # -- the example's: wait for the cohort, so that the peers start together ------------------
    deadline = time.monotonic() + (args.max_seconds or 1e9)
    while len(group.members()) < args.wait_for and not stop.is_set():
        if time.monotonic() > deadline:
            stop.set()
        group.update()
        time.sleep(0.05)
    initial = workload.evaluate(model, corpus)
    print(f"in a cohort of {len(group.members())}; loss {initial:.3f}", flush=True)
    started = time.monotonic()

    # -- the reference's loop ------------------------------------------------------------------
    while not stop.is_set():  # (the example's: until --rounds or Ctrl+C; moolib's: while True)
        # Update the status of the objects across the network
        group.update()
        accumulator.update()

        # 0. Check we are connected.
        if not accumulator.connected():
            time.sleep(0.25)
            continue

        # 1. Synchronize our state.
        if accumulator.wants_state():
            accumulator.set_state({"optimizer": opt.state_dict()})
        if accumulator.has_new_state():
            opt.load_state_dict(accumulator.state()["optimizer"])  # type: ignore[index]

        # 2. Generate our gradients then reduce them.
        if accumulator.wants_gradients():
            X, y = next(data)
            loss = workload.loss_fn(model, X, y)
            loss.backward()
            accumulator.reduce_gradients(batch_size)  # has_gradients() -> True after this

        # 3. Step our gradients then reset.
        if accumulator.has_gradients():
            opt.step()
            accumulator.zero_gradients()  # has_gradients() -> False after this

            # -- the example's: a line every few results, and the bounds --
            version = accumulator.model_version()
            if version % args.report_every == 0:
                stats = accumulator.get_gradient_stats()
                rate = version / max(time.monotonic() - started, 1e-9)
                leader = (accumulator.get_leader() or "?")[-6:]
                print(
                    f"version {version}: loss {workload.evaluate(model, corpus):.3f}, "
                    f"{stats['num_gradients']} gradients of {stats['batch_size']} samples, "
                    f"{rate:.1f} results/s, leader ...{leader}",
                    flush=True,
                )
            if args.rounds and version >= args.rounds:
                break
        if args.max_seconds and time.monotonic() > deadline:
            break

    # -- the example's: serve the others a moment, then leave -----------------------------------
    end = time.monotonic() + args.linger
    while time.monotonic() < end:
        group.update()
        accumulator.update()
        if accumulator.wants_state():
            accumulator.set_state({"optimizer": opt.state_dict()})
        time.sleep(0.02)
    version = accumulator.model_version()
    accumulator.shutdown()
    group.shutdown()
    dht.shutdown()
    final = workload.evaluate(model, corpus)
    print(
        f"final: version {version}, loss {initial:.3f} -> {final:.3f}, "
        f"params sha256 {params_digest(model)}",
        flush=True,
    )
    return 0


def launch(args: argparse.Namespace) -> int:
    """``--peers N``: N peer processes of this script (the first one's address for the others);
    their lines relayed; Ctrl+C ends them with SIGINT."""
    common = [
        "--rounds",
        str(args.rounds),
        "--batch-size",
        str(args.batch_size),
        "--virtual-batch-size",
        str(args.virtual_batch_size),
        "--wait-for",
        str(args.peers),
        "--report-every",
        str(args.report_every),
        "--linger",
        str(args.linger),
        "--max-seconds",
        str(args.max_seconds),
    ]
    procs: list[subprocess.Popen[str]] = []
    finals: dict[int, re.Match[str]] = {}
    address: list[str] = []
    have_address = threading.Event()

    def relay(index: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            print(f"[peer {index}] {line}", flush=True)
            if index == 0 and line.startswith("address: "):
                address.append(line.removeprefix("address: "))
                have_address.set()
            if match := FINAL.search(line):
                finals[index] = match
        have_address.set()  # (peer 0 ended early: do not wait for its address)

    def start(index: int, join: list[str]) -> None:
        argv = [sys.executable, __file__, "--peer-index", str(index), *join, *common]
        # (a session of its own: Ctrl+C reaches this process alone, which ends the peers once)
        proc = subprocess.Popen(  # noqa: S603 (this script, by its path)
            argv, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        procs.append(proc)
        thread = threading.Thread(target=relay, args=(index, proc), daemon=True)
        thread.start()
        threads.append(thread)

    threads: list[threading.Thread] = []
    try:
        start(0, [])
        if not have_address.wait(120) or not address:
            print("peer 0 printed no address", file=sys.stderr)
            return 1
        for index in range(1, args.peers):
            start(index, ["--initial-peers", address[0]])
        while any(proc.poll() is None for proc in procs):
            if any(proc.poll() for proc in procs):  # (one failed: end the others)
                raise KeyboardInterrupt
            time.sleep(0.1)
    except KeyboardInterrupt:
        print("stopping the peers", flush=True)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
    finally:
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for thread in threads:
            thread.join(5)
    codes = [proc.returncode for proc in procs]
    if len(finals) != args.peers or any(codes):
        print(f"not every peer ended well: exit codes {codes}", flush=True)
        return 1
    versions = {int(m.group(1)) for m in finals.values()}
    digests = {m.group(4) for m in finals.values()}
    losses = [float(m.group(3)) for m in finals.values()]
    same = len(versions) == 1 and len(digests) == 1
    print(
        f"{args.peers} peers ended at version(s) {sorted(versions)}, "
        f"{'equal' if same else 'DIFFERENT'} parameters; final loss "
        + ", ".join(f"{loss:.3f}" for loss in losses),
        flush=True,
    )
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.peers:
        return launch(args)
    return peer(args)


if __name__ == "__main__":
    sys.exit(main())
