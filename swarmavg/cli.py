"""The ``swarmavg`` command line: a demo swarm, a DHT node, a run's status, checks, ping.

``swarmavg demo`` is the main job: it starts a swarm of peer processes on this machine, which
train a small model together with ``swarmavg.Optimizer``, shows them live and plots their
validation loss against one process training alone (see :mod:`swarmavg._train_demo`).
``swarmavg demo averaging`` shows the mechanism underneath: the peers average random tensors in
small groups round after round, converging to the exact mean (see :mod:`swarmavg._demo`).
``swarmavg serve`` starts a node that answers ``ping`` calls and takes bulk uploads, and prints
the address to dial it at (with its PeerID, so the caller can check who answers).
``swarmavg ping ADDRESS`` calls such a node: it connects (both sides prove their keys),
measures the round trip of unary RPC calls and the rate of a bulk upload.
``swarmavg link-demo`` does both on this machine: it starts ``swarmavg serve`` in a second
process on the loopback interface and pings it.
``swarmavg dht`` runs a long-lived DHT peer (a bootstrap node for a swarm) with a persistent
identity, prints the addresses to pass as ``initial_peers`` and logs its state every minute.
``swarmavg status RUN_ID`` shows a training run live and ``swarmavg doctor`` checks this
machine and its peers (see :mod:`swarmavg._status`, :mod:`swarmavg._doctor`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from swarmavg import __version__
from swarmavg._demo import DemoOptions, option_error, run_demo
from swarmavg._train_demo import PLOT_NAME as TRAIN_PLOT_NAME
from swarmavg._train_demo import TrainOptions, run_training_demo
from swarmavg._train_demo import option_error as train_option_error
from swarmavg._train_demo_peer import OPTIMIZERS
from swarmavg.abc import ConnectionAttribute
from swarmavg.address import Address
from swarmavg.aio.node import Node
from swarmavg.aio.rpc import CallContext
from swarmavg.errors import SwarmError
from swarmavg.proto import Ping, Pong, TensorChunk

__all__ = ["main"]

#: Size of one message of the bulk upload.
CHUNK_BYTES = 1 << 20
#: How long ``ping`` waits for each step before giving up.
STEP_TIMEOUT = 60.0


# -- serve ---------------------------------------------------------------------------------------


async def _pong(request: Ping, ctx: CallContext) -> Pong:
    return Pong(request.nonce)


async def _sink(chunks: AsyncIterator[TensorChunk], ctx: CallContext) -> Pong:
    """Take a bulk upload; answer with the number of bytes received."""
    total = 0
    async for chunk in chunks:
        total += chunk.array.nbytes
    return Pong(total)


def _transport_options(encryption: bool) -> dict[str, dict[str, Any]]:
    return {"tcp": {"encryption": encryption}}


def _dialable(address: Address) -> str:
    """The address as a peer dials it: a wildcard host becomes a placeholder to fill in."""
    text = str(address)
    for wildcard in ("//0.0.0.0:", "//[::]:"):
        if wildcard in text:
            return text.replace(wildcard, "//<this machine's IP>:")
    return text


async def _serve(
    listen: list[str], identity: str | None, encryption: bool, until_stdin_closes: bool
) -> None:
    async with Node(
        identity=identity, listen=listen, transports=_transport_options(encryption)
    ) as node:
        node.rpc.register("ping", _pong, request_type=Ping)
        node.rpc.register("upload", _sink, kind="client_stream", request_type=TensorChunk)
        if until_stdin_closes:  # machine-readable, for `swarmavg link-demo`
            print(str(node.addresses[0]), flush=True)
        else:
            print(f"serving as {node.peer_id}")
            for address in node.addresses:
                print(f"  dial me at: {_dialable(address)}")
            print("Ctrl+C stops.", flush=True)
        if until_stdin_closes:
            # the parent closes our stdin when it is done (or dies): then we exit
            await anyio.to_thread.run_sync(sys.stdin.buffer.read, abandon_on_cancel=True)
        else:
            await anyio.sleep_forever()


# -- dht -----------------------------------------------------------------------------------------

_logger = logging.getLogger("swarmavg.cli")


async def _dht(
    listen: list[str],
    identity: str,
    initial_peers: list[str],
    announce: list[str],
    log_interval: float,
    until_stdin_closes: bool,
) -> None:
    from swarmavg.aio.dht_facade import DHT

    async with DHT(
        initial_peers, host_maddrs=listen, identity=identity, announce_maddrs=announce or None
    ) as dht:
        print(f"DHT peer {dht.peer_id} (identity in {identity})")
        print("other peers join with initial_peers=[...] any of:")
        for maddr in dht.get_visible_maddrs():
            print(f"  {maddr}")
        print("Ctrl+C stops.", flush=True)

        async def report() -> None:
            started = time.monotonic()
            while True:
                await anyio.sleep(log_interval)
                node = dht.dht_node
                _logger.info(
                    "up %.0f s: %d peers in the routing table, %d records stored, %d cached",
                    time.monotonic() - started,
                    node.routing_table_size,
                    len(node.protocol.storage),
                    len(node.cache) if node.cache is not None else 0,
                )

        async with anyio.create_task_group() as tg:
            tg.start_soon(report)
            if until_stdin_closes:
                await anyio.to_thread.run_sync(sys.stdin.buffer.read, abandon_on_cancel=True)
            else:
                await anyio.sleep_forever()
            tg.cancel_scope.cancel()


# -- ping ----------------------------------------------------------------------------------------


async def _ping(address: str, calls: int, megabytes: int, encryption: bool) -> None:
    async with Node(transports=_transport_options(encryption)) as node:
        start = time.perf_counter()
        with anyio.fail_after(STEP_TIMEOUT):
            conn = await node.connect(address)
        connect_ms = (time.perf_counter() - start) * 1e3
        peer = conn.extra(ConnectionAttribute.peer_id)
        how = "encrypted" if conn.extra(ConnectionAttribute.encrypted, False) else "NOT encrypted"
        kind = conn.extra(ConnectionAttribute.transport_name, "?")
        print(f"connected to {peer} over {kind} in {connect_ms:.1f} ms: its key is proven, {how}")

        samples = []
        for nonce in range(calls + max(calls // 10, 1)):  # the first tenth warms up
            start = time.perf_counter()
            pong = await node.rpc.call(
                peer, "ping", Ping(nonce), response_type=Pong, timeout=STEP_TIMEOUT
            )
            samples.append(time.perf_counter() - start)
            if pong.nonce != nonce:
                raise SwarmError(f"ping {nonce} was answered with pong {pong.nonce}")
        samples = sorted(samples[-calls:])
        print(
            f"rpc round trip ({calls} unary calls): median "
            f"{statistics.median(samples) * 1e6:.0f} µs, p90 "
            f"{samples[int(len(samples) * 0.9)] * 1e6:.0f} µs"
        )

        if megabytes:
            array = np.zeros(CHUNK_BYTES, dtype=np.uint8)
            start = time.perf_counter()
            chunks = (TensorChunk("bulk", index, array) for index in range(megabytes))
            reply = await node.rpc.client_stream(
                peer, "upload", chunks, response_type=Pong, timeout=STEP_TIMEOUT + megabytes
            )
            elapsed = time.perf_counter() - start
            if reply.nonce != megabytes * CHUNK_BYTES:
                raise SwarmError(f"sent {megabytes} MiB, the peer got {reply.nonce} bytes")
            rate = megabytes * CHUNK_BYTES / elapsed
            rate_text = f"{rate / 1e9:.2f} GB/s" if rate >= 1e9 else f"{rate / 1e6:.0f} MB/s"
            print(
                f"bulk upload: {megabytes} MiB in {elapsed:.2f} s = {rate_text} "
                f"(client-stream call of 1 MiB tensor chunks, acknowledged by the peer)"
            )


# -- link-demo -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _server_process(encryption: bool, transport: str) -> Iterator[str]:
    """``swarmavg serve`` on loopback in a child process; yields its address."""
    listen = f"{transport}://127.0.0.1:0"
    command = [sys.executable, "-m", "swarmavg.cli", "serve", "--listen", listen]
    command += ["--until-stdin-closes"] + ([] if encryption else ["--no-encryption"])
    child = subprocess.Popen(  # noqa: S603 (this interpreter, constant arguments)
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert child.stdout is not None
        address = child.stdout.readline().strip()
        if not address:
            raise SwarmError(f"the server process failed to start (exit code {child.wait(10)})")
        yield address
    finally:
        if child.stdin is not None:
            child.stdin.close()  # tells it to stop
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()


def _link_demo(calls: int, megabytes: int, encryption: bool, transport: str) -> None:
    if transport != "tcp" and not encryption:
        raise SwarmError(f"--no-encryption applies to tcp only; {transport} always encrypts")
    with _server_process(encryption, transport) as address:
        print(f"started `swarmavg serve` in process 2, listening at {address}")
        anyio.run(_ping, address, calls, megabytes, encryption)


# -- entry point ---------------------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {value}")
    return value


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}


def _count(text: str) -> int:
    """A positive count such as ``4000000``, ``4_000_000``, ``4M`` or ``100k``."""
    scale = _SUFFIXES.get(text[-1:].lower(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = round(float(number) * scale) if scale > 1 else int(number)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(
            f"not a count: {text!r} (use e.g. 100000, 100k or 4M)"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``swarmavg`` command."""
    parser = argparse.ArgumentParser(
        prog="swarmavg",
        description="swarmavg: train one PyTorch model together with peers you neither trust\n"
        "nor control. Try a local swarm, run a bootstrap node, watch a run, check a machine.",
        epilog="examples:\n"
        "  swarmavg demo                      four peers train a small model together, live\n"
        "  swarmavg demo --kill-one           ... and one of them dies halfway\n"
        "  swarmavg demo averaging            the tensor averaging underneath\n"
        "  swarmavg dht --listen tcp://0.0.0.0:31337   a bootstrap node for a swarm\n"
        "  swarmavg status RUN_ID --initial-peers ADDR  a training run, live\n"
        "  swarmavg doctor ADDR               can this machine reach that peer?\n"
        "\n'swarmavg COMMAND --help' tells more about each command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"swarmavg {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)

    def measured(cmd: argparse.ArgumentParser) -> None:
        cmd.add_argument("--calls", type=_positive, default=500, help="unary calls to time")
        cmd.add_argument(
            "--megabytes", type=_non_negative, default=1024, help="size of the bulk upload"
        )

    def encrypted(cmd: argparse.ArgumentParser) -> None:
        cmd.add_argument(
            "--no-encryption",
            dest="encryption",
            action="store_false",
            help="send data in the clear (peers are still authenticated); both ends must agree",
        )

    train_defaults = TrainOptions()
    demo = sub.add_parser(
        "demo",
        help="train a model in a swarm of peer processes on loopback, live, with a plot",
        description="Start a swarm of peer processes on this machine that train a small "
        "transformer together with the chosen optimizer (and one process that trains alone with "
        "the same global batch, to compare); show each peer's epoch, speed, loss and group live; "
        "then a summary table and a plot of the validation loss and of the time per epoch. "
        "`swarmavg demo averaging` averages random tensors instead (the mechanism underneath).",
    )
    demo.add_argument(
        "--peers",
        type=int,
        default=train_defaults.peers,
        help=f"peer processes (default {train_defaults.peers})",
    )
    demo.add_argument(
        "--epochs",
        type=int,
        default=train_defaults.epochs,
        help=f"epochs to train (default {train_defaults.epochs}: about a minute on 2 cores)",
    )
    demo.add_argument(
        "--target-batch-size",
        type=int,
        default=train_defaults.target_batch_size,
        help=f"samples per epoch, over all peers (default {train_defaults.target_batch_size})",
    )
    demo.add_argument(
        "--batch-size",
        type=int,
        default=train_defaults.batch_size,
        help=f"samples per step() of each peer (default {train_defaults.batch_size})",
    )
    demo.add_argument(
        "--transport",
        choices=("tcp", "quic"),
        default=train_defaults.transport,
        help="transport of the peers (quic needs `pip install swarmavg[quic]`)",
    )
    demo.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default=train_defaults.optimizer,
        help="; ".join(f"{name}: {spec.description}" for name, spec in OPTIMIZERS.items())
        + f" (default {train_defaults.optimizer})",
    )
    demo.add_argument(
        "--kill-one",
        action="store_true",
        help="SIGKILL one peer halfway through and watch the others go on",
    )
    demo.add_argument(
        "--no-plot", dest="plot", action="store_false", help="no plot (nor CSV file) at the end"
    )
    demo.add_argument(
        "--out",
        type=Path,
        default=train_defaults.out,
        help=f"directory for the plot, {TRAIN_PLOT_NAME} (a CSV file without matplotlib); "
        "default: the current directory",
    )
    demo.set_defaults(demo_command="training")
    demo_sub = demo.add_subparsers(dest="demo_command", metavar="{averaging}")
    defaults = DemoOptions()
    averaging = demo_sub.add_parser(
        "averaging",
        help="average random tensors in a swarm of peer processes on loopback, with a plot",
        description="Start a swarm of peer processes on this machine that average random "
        "tensors in small groups (Moshpit), and show each round's groups, timings and distance "
        "to the exact mean; plot the convergence.",
    )
    averaging.add_argument(
        "--peers",
        type=int,
        default=defaults.peers,
        help=f"peer processes (default {defaults.peers})",
    )
    averaging.add_argument(
        "--rounds", type=int, default=defaults.rounds, help=f"rounds (default {defaults.rounds})"
    )
    averaging.add_argument(
        "--size",
        type=_count,
        default=defaults.size,
        help=f"float32 elements per peer, split into a few tensors; 100k, 4M, … are fine "
        f"(default {defaults.size:_})",
    )
    averaging.add_argument(
        "--group-size",
        type=int,
        default=defaults.group_size,
        help=f"peers per averaging group (default {defaults.group_size})",
    )
    averaging.add_argument(
        "--transport",
        choices=("tcp", "quic"),
        default=defaults.transport,
        help="transport of the peers (quic needs `pip install swarmavg[quic]`)",
    )
    averaging.add_argument(
        "--no-encryption",
        dest="encryption",
        action="store_false",
        help="tcp: send the tensors in the clear (peers are still authenticated)",
    )
    averaging.add_argument(
        "--plot",
        type=Path,
        default=defaults.plot,
        help=f"where to write the convergence plot (PNG; default ./{defaults.plot}); a CSV "
        f"file beside it without matplotlib",
    )
    averaging.add_argument(
        "--seed", type=int, default=defaults.seed, help="seed of the peers' random tensors"
    )
    link_demo = sub.add_parser(
        "link-demo", help="serve in a second process on loopback and ping it"
    )
    measured(link_demo)
    encrypted(link_demo)
    link_demo.add_argument(
        "--transport",
        choices=("tcp", "quic"),
        default="tcp",
        help="transport of the two nodes (quic needs `pip install swarmavg[quic]`)",
    )
    serve = sub.add_parser("serve", help="start a node that answers `swarmavg ping`")
    serve.add_argument(
        "--listen",
        action="append",
        help="address to listen on, tcp://… or quic://… (repeatable; default tcp://0.0.0.0:7000)",
    )
    serve.add_argument(
        "--identity", metavar="KEY_FILE", help="key file to keep the same PeerID across runs"
    )
    serve.add_argument("--until-stdin-closes", action="store_true", help=argparse.SUPPRESS)
    encrypted(serve)
    dht = sub.add_parser("dht", help="run a long-lived DHT peer that others bootstrap from")
    dht.add_argument(
        "--listen",
        action="append",
        help="address to listen on, tcp://…, quic://… or a multiaddr (repeatable; "
        "default tcp://0.0.0.0:31337)",
    )
    dht.add_argument(
        "--identity",
        metavar="KEY_FILE",
        default="swarmavg-dht.key",
        help="key file that keeps the PeerID across restarts (created if missing; "
        "default ./swarmavg-dht.key)",
    )
    dht.add_argument(
        "--initial-peer",
        dest="initial_peers",
        action="append",
        default=[],
        help="address of a running DHT peer to join (repeatable)",
    )
    dht.add_argument(
        "--announce",
        metavar="ADDRESS",
        action="append",
        default=[],
        help="address to tell other peers instead of the listening ones, e.g. the public "
        "address of a router that forwards the port here (repeatable)",
    )
    dht.add_argument(
        "--log-interval", type=float, default=60.0, help="seconds between status log lines"
    )
    dht.add_argument("--until-stdin-closes", action="store_true", help=argparse.SUPPRESS)
    ping = sub.add_parser("ping", help="call a node started with `swarmavg serve`")
    ping.add_argument("address", help="the address `swarmavg serve` printed, with /p/<peer id>")
    measured(ping)
    encrypted(ping)

    status = sub.add_parser(
        "status",
        help="show a training run live: its peers, epochs, samples/s, the epoch's ETA",
        description="Join the DHT as a client and show the run RUN_ID as its peers' signed "
        "progress records tell it: each peer's epoch, samples, samples/s, mode and the age of "
        "its record; the global epoch, its samples and ETA; the peers that look for an "
        "averaging group now. Refreshes every --interval seconds until Ctrl+C.",
    )
    status.add_argument("run_id", metavar="RUN_ID", help="the run's name (Optimizer's run_id)")
    status.add_argument(
        "--initial-peers",
        nargs="+",
        required=True,
        metavar="ADDR",
        help="addresses of running DHT peers of the swarm (e.g. what `swarmavg dht` printed)",
    )
    status.add_argument("--once", action="store_true", help="print one snapshot and exit")
    status.add_argument(
        "--json", action="store_true", help="print JSON, one object per snapshot and line"
    )
    status.add_argument(
        "--interval", type=float, default=2.0, help="seconds between snapshots (default 2)"
    )
    status.add_argument(
        "--target-batch-size",
        type=_positive,
        metavar="N",
        help="the run's samples per epoch, for the ETA (the records do not carry it)",
    )
    status.add_argument(
        "--timeout", type=float, default=10.0, help="seconds a DHT read may take (default 10)"
    )
    doctor = sub.add_parser(
        "doctor",
        help="check this machine and peers: transports, addresses, round trips, clock skew",
        description="Check what a swarm needs, one line per check, ok or what to do: the "
        "installed transports, the addresses this machine listens on and advertises, and for "
        "each ADDR whether the peer answers over TCP and QUIC, how fast, and how far its "
        "clock is off ours. Exit code 0 if no check failed.",
    )
    doctor.add_argument("peers", nargs="*", metavar="ADDR", help="peer addresses to check")
    doctor.add_argument(
        "--host",
        default="0.0.0.0",  # noqa: S104 (the listening check: where a swarm peer listens)
        help="interface to check listening on (default 0.0.0.0: all)",
    )
    doctor.add_argument(
        "--port", type=_non_negative, default=0, help="port to check listening on (default any)"
    )
    doctor.add_argument(
        "--timeout", type=float, default=5.0, help="seconds a connection or call may take"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG
        if args.verbose
        else logging.INFO
        if args.command == "dht"
        else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "demo" and args.demo_command == "averaging":
            options = DemoOptions(
                peers=args.peers,
                rounds=args.rounds,
                size=args.size,
                group_size=args.group_size,
                transport=args.transport,
                encryption=args.encryption,
                plot=args.plot,
                seed=args.seed,
            )
            problem = option_error(options)
            if problem is not None:
                averaging.error(problem)
            run_demo(options)
        elif args.command == "demo":
            train_options = TrainOptions(
                peers=args.peers,
                epochs=args.epochs,
                target_batch_size=args.target_batch_size,
                batch_size=args.batch_size,
                transport=args.transport,
                optimizer=args.optimizer,
                kill_one=args.kill_one,
                plot=args.plot,
                out=args.out,
            )
            problem = train_option_error(train_options)
            if problem is not None:
                demo.error(problem)
            run_training_demo(train_options)
        elif args.command == "link-demo":
            _link_demo(args.calls, args.megabytes, args.encryption, args.transport)
        elif args.command == "dht":
            if not args.log_interval > 0:
                parser.error("--log-interval must be a positive number of seconds")
            listen = args.listen or ["tcp://0.0.0.0:31337"]
            anyio.run(
                _dht,
                listen,
                args.identity,
                args.initial_peers,
                args.announce,
                args.log_interval,
                args.until_stdin_closes,
            )
        elif args.command == "status":
            from swarmavg import _status

            try:
                status_options = _status.options_from(**vars(args))
            except ValueError as exc:
                status.error(str(exc))
            return _status.run(status_options)
        elif args.command == "doctor":
            from swarmavg import _doctor

            try:
                doctor_options = _doctor.DoctorOptions(
                    tuple(args.peers), args.host, args.port, args.timeout
                )
            except ValueError as exc:
                doctor.error(str(exc))
            return _doctor.run(doctor_options)
        elif args.command == "serve":
            listen = args.listen or ["tcp://0.0.0.0:7000"]
            anyio.run(_serve, listen, args.identity, args.encryption, args.until_stdin_closes)
        else:
            try:
                Address.parse(args.address)
            except ValueError as exc:
                parser.error(f"address: {exc}")
            anyio.run(_ping, args.address, args.calls, args.megabytes, args.encryption)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (SwarmError, OSError, TimeoutError, ValueError) as exc:
        print(f"swarmavg {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
