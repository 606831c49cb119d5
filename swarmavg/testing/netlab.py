"""A network lab: hosts in network namespaces behind emulated internet links (Linux, root).

::

    from swarmavg.testing.netlab import NetLab, WAN

    with NetLab(3, profile="wan") as lab:           # 3 hosts, 100 Mbit/s, 40 ms RTT, 0.1% loss
        server = lab.host(0).popen(["python", "-m", "http.server", "-b", lab.host(0).address])
        lab.host(1).run(["curl", f"http://{lab.host(0).address}:8000/"], timeout=10)
        lab.host(2).set_link(False)                 # cut host 2 off (partition, kill tests)
        lab.set_profile(1, "bad")                   # change host 1's link live
        lab.partition([0], [1, 2])                  # cut the paths between 0 and 1, 2
        lab.partition()                             # and heal them

How it is built (see ``docs/design/netlab.md``):

- one network namespace per host (``sanl-<pid>-<n>-h<i>``), with one interface ``eth0``,
  address ``10.77.0.<i+1>/24``, a fixed MAC, static neighbour entries for every other host (no
  ARP) and IPv6 off;
- one *core* namespace (``sanl-<pid>-<n>-core``) holding the other end of each host's veth pair
  (``h<i>``) and the link emulator (``_netemu.py``): a userspace switch that forwards frames
  between the core ends, adding each link's delay, jitter, loss and reordering. With
  ``emulate=False`` a kernel bridge joins the core ends instead (rates only, full kernel speed);
- ``tc tbf`` on both ends of each veth: the host's end shapes its upload, the core end its
  download.

Nothing of the lab is in the root namespace, so it cannot touch the machine's own interfaces,
routes or addresses, and the hosts reach nothing but each other. Everything is removed by
:meth:`NetLab.close` (on leaving the ``with``, also by an exception or Ctrl+C, and at interpreter
exit); a lab left behind by a process that died is removed by the next lab that starts
(:func:`cleanup_stale`).

stdlib only: the lab needs ``ip`` and ``tc`` (iproute2) and root, nothing else.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import itertools
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "BAD",
    "LAN",
    "PROFILES",
    "WAN",
    "LinkProfile",
    "NetLab",
    "NetLabError",
    "NetLabHost",
    "cleanup_stale",
    "tso_rtt_log",
    "unavailable_reason",
]

PREFIX = "sanl-"
SUBNET = "10.77.0"
EMULATOR = Path(__file__).with_name("_netemu.py")
CLONE_NEWNET = 0x40000000
COMMAND_TIMEOUT = 20.0
#: The smallest offload frame (bytes) the hosts' TCP builds on its longest path, however slowly
#: a flow is paced (see :func:`tso_rtt_log`).
TSO_MIN_FRAME = 16 << 10


def tso_rtt_log(rtt_s: float) -> int:
    """The ``net.ipv4.tcp_tso_rtt_log`` a lab host gets (with offload) when its longest path
    has ``rtt_s`` of round trip: TCP sizes a flow's offload frames to a millisecond of its
    pacing rate plus ``64 KiB >> (min_rtt_us >> log)``, so this log makes frames of at least
    :data:`TSO_MIN_FRAME` on every path of the host (14 on ``wan``, 16 on ``bad``; never below
    the kernel's default, 9, which adds nothing beyond ~5 ms). Without it, 8 hosts each sending
    to the 7 others make frames of one or two packets and the emulator, not the links, sets the
    rate (see the docs)."""
    if not (math.isfinite(rtt_s) and rtt_s >= 0):
        raise ValueError(f"rtt_s must be a finite number >= 0, got {rtt_s!r}")
    rtt_us = int(rtt_s * 1e6)
    log = 9
    while (65536 >> min(rtt_us >> log, 17)) < TSO_MIN_FRAME:
        log += 1
    return log


_counter = itertools.count()


class NetLabError(RuntimeError):
    """The lab could not be built or driven (a command failed, the emulator died or did not
    answer)."""


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """A host's access link. The path between two hosts of the same profile has ``rtt_s`` of
    round trip and ``loss`` per packet in each direction; between two profiles, each host
    contributes half of its own.

    ``rate_bps``: upload rate in bits/s (``None``: unshaped); ``down_rate_bps``: download rate
    (``None``: the same as upload). ``jitter_s``: each of the 4 hops of a round trip draws its
    delay uniformly in ``rtt_s/4 ± jitter_s/2`` (frames of a pair stay in order). ``reorder``:
    probability, per packet and path, that it overtakes the ones before it. ``queue_s``: the
    rate limiter's queue, in seconds at the rate (drop-tail beyond). ``burst_s``: the token
    bucket's burst, in seconds at the rate (at least 2 full-size frames).
    """

    rate_bps: float | None
    rtt_s: float = 0.0
    loss: float = 0.0
    jitter_s: float = 0.0
    reorder: float = 0.0
    down_rate_bps: float | None = None
    queue_s: float = 0.05
    burst_s: float = 0.001

    def __post_init__(self) -> None:
        for name in ("rate_bps", "down_rate_bps"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 8000):
                raise ValueError(f"{name} must be None or at least 8000 bits/s, got {value!r}")
        for name in ("rtt_s", "jitter_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= 10):
                raise ValueError(f"{name} must be between 0 and 10 seconds, got {value!r}")
        for name in ("queue_s", "burst_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 < value <= 10):
                raise ValueError(f"{name} must be in (0, 10] seconds, got {value!r}")
        for name in ("loss", "reorder"):
            value = getattr(self, name)
            if not (0 <= value < 1):
                raise ValueError(f"{name} must be a probability in [0, 1), got {value!r}")

    def replace(self, **changes: Any) -> LinkProfile:
        """A copy with ``changes`` (``WAN.replace(rate_bps=50e6)``)."""
        return dataclasses.replace(self, **changes)

    @property
    def emulated(self) -> bool:
        """Whether the profile needs the emulator (delay, jitter, loss or reordering)."""
        return bool(self.rtt_s or self.jitter_s or self.loss or self.reorder)

    def hop(self) -> dict[str, float]:
        """One direction of the access link, as the emulator takes it: a quarter of the round
        trip, and the loss that makes two hops lose ``loss``."""
        return {
            "delay": self.rtt_s / 4,
            "jitter": self.jitter_s,
            "loss": 1.0 - math.sqrt(1.0 - self.loss),
            "reorder": self.reorder / 2,
        }


LAN = LinkProfile(rate_bps=1e9, rtt_s=0.0005)
"""1 Gbit/s, 0.5 ms round trip, no loss."""
WAN = LinkProfile(rate_bps=100e6, rtt_s=0.040, loss=0.001)
"""100 Mbit/s, 40 ms round trip, 0.1% loss."""
BAD = LinkProfile(rate_bps=20e6, rtt_s=0.150, loss=0.01, jitter_s=0.010, reorder=0.001)
"""20 Mbit/s, 150 ms round trip, 1% loss, ±5 ms per hop of jitter, 0.1% reordering."""
PROFILES: Mapping[str, LinkProfile] = {"lan": LAN, "wan": WAN, "bad": BAD}


def _profile(value: LinkProfile | str, name: str) -> LinkProfile:
    if isinstance(value, LinkProfile):
        return value
    if isinstance(value, str):
        try:
            return PROFILES[value]
        except KeyError:
            known = sorted(PROFILES)
            raise ValueError(f"{name}: unknown profile {value!r} (one of {known})") from None
    raise TypeError(f"{name} must be a LinkProfile or a profile name, got {type(value).__name__}")


# -- running commands


def _run(argv: Sequence[str], *, input: str | None = None) -> str:
    try:
        done = subprocess.run(  # noqa: S603 (iproute2 with the lab's own names)
            list(argv),
            input=input,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise NetLabError(f"{' '.join(argv)}: no answer in {COMMAND_TIMEOUT} s") from None
    if done.returncode != 0:
        raise NetLabError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _setns(fd: int) -> None:
    setns = getattr(os, "setns", None)
    if setns is not None:  # Python 3.12+
        setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def unavailable_reason() -> str | None:
    """Why the lab cannot run here (not Linux, not root, no ``ip`` or ``tc``), or ``None``."""
    if not sys.platform.startswith("linux"):
        return "the network lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the network lab needs `{tool}` (iproute2)"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lab_namespaces() -> list[str]:
    names = []
    for line in _run(["ip", "netns", "list"]).splitlines():
        name = line.split(" ", 1)[0]
        if name.startswith(PREFIX):
            names.append(name)
    return names


def _delete_namespace(name: str) -> None:
    """Kill what runs in namespace ``name`` and delete it (a missing one is fine)."""
    with contextlib.suppress(NetLabError):
        for pid in _run(["ip", "netns", "pids", name]).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    try:
        _run(["ip", "netns", "delete", name])
    except NetLabError as exc:
        if "No such file" not in str(exc):
            raise


def cleanup_stale() -> list[str]:
    """Remove the namespaces (and the processes in them) of labs whose owner process is gone;
    returns their names. Labs of live processes are left alone."""
    removed = []
    for name in _lab_namespaces():
        owner = name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and _pid_alive(int(owner)):
            continue
        _delete_namespace(name)
        removed.append(name)
    return removed


# -- the lab


class NetLabHost:
    """One host of a :class:`NetLab`: a network namespace with one address."""

    def __init__(self, lab: NetLab, index: int) -> None:
        self.lab = lab
        self.index = index
        self.netns = f"{lab.name}-h{index}"
        """The network namespace's name (``ip netns exec <netns> ...``)."""
        self.address = f"{SUBNET}.{index + 1}"
        """The host's IPv4 address (on ``eth0``); the hosts reach each other and nothing else."""
        self.mac = f"02:77:00:00:{index >> 8:02x}:{index & 0xFF:02x}"
        self.core_ifname = f"h{index}"
        self.profile: LinkProfile = LAN
        self.tso_rtt_log: int | None = None
        """The host's ``net.ipv4.tcp_tso_rtt_log`` (``None``: the kernel's; see
        :func:`tso_rtt_log`)."""

    def __repr__(self) -> str:
        return f"<NetLabHost {self.index} {self.address} in {self.netns}>"

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in this host (``subprocess.Popen`` arguments in ``kwargs``; it runs in
        its own session). The lab kills it, if it still runs, and closes its pipes when the
        lab closes."""
        self.lab._check_open()
        kwargs.setdefault("start_new_session", True)
        process: subprocess.Popen[Any] = subprocess.Popen(  # noqa: S603 (the caller's command)
            ["ip", "netns", "exec", self.netns, *argv],  # noqa: S607 (ip from PATH, checked)
            **kwargs,
        )
        self.lab._processes.append(process)
        return process

    def run(self, argv: Sequence[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in this host to completion (text output captured; killed and
        ``subprocess.TimeoutExpired`` raised after ``timeout`` seconds)."""
        process = self.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(process)
            raise
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    def call(self, function: Callable[..., Any], *args: Any, timeout: float) -> Any:
        """Run ``function(*args)`` in a fresh Python process in this host and return its
        result. ``function`` must be importable by module and name (a module-level function),
        ``args`` and the result JSON values. Raises :class:`NetLabError` if it raised (with its
        traceback) and ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        module, name = function.__module__, function.__qualname__
        if "<" in name:
            raise ValueError(f"function must be a module-level function, got {name}")
        env = dict(os.environ)
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        done = self.run(
            [sys.executable, "-c", _CALL, module, name, json.dumps(list(args))],
            timeout=timeout,
        )
        if done.returncode != 0:
            raise NetLabError(f"{module}.{name} in host {self.index}: {done.stderr.strip()}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Switch the *calling thread* into this host's namespace for the ``with``: sockets
        made inside stay in the host for their whole life, and threads started inside live in
        it too. Other threads are unaffected."""
        self.lab._check_open()
        with (
            open(f"/proc/self/task/{threading.get_native_id()}/ns/net") as original,
            open(f"/run/netns/{self.netns}") as target,
        ):
            _setns(target.fileno())
            try:
                yield
            finally:
                _setns(original.fileno())

    def set_link(self, up: bool) -> None:
        """Cut (``False``) or restore (``True``) this host's link: while it is cut, every
        packet from or to it is lost, including those already on the way (a pulled cable,
        as far as the other hosts can tell; the host's own interface stays up)."""
        self.lab.set_link(self.index, up)

    def set_profile(self, profile: LinkProfile | str) -> None:
        """Change this host's link to ``profile``, live (see :meth:`NetLab.set_profile`)."""
        self.lab.set_profile(self.index, profile)


_CALL = """
import importlib, json, sys
module, name, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
target = importlib.import_module(module)
for part in name.split("."):
    target = getattr(target, part)
result = target(*args)
sys.stdout.write("\\n" + json.dumps(result) + "\\n")
"""


def _kill(process: subprocess.Popen[Any], grace: float = 2.0) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace)


class NetLab:
    """``hosts`` hosts behind emulated links, as a context manager (see the module docstring).

    ``hosts``: a number of hosts (each with ``profile``), or one profile per host (a
    heterogeneous swarm: ``[LAN, LAN, WAN.replace(rate_bps=50e6)]``). ``seed`` seeds the
    emulator's loss, jitter and reordering. ``offload`` (the default): let TCP hand the
    links segmentation-offload frames of up to 64 KiB (the emulator handles several times
    fewer frames and sustains far higher rates; it still loses and reorders each packet on its
    own: a frame with lost or reordered segments is cut as the kernel would have cut it, the
    lost segments dropped, a reordered one sent ahead alone; a hop's delay draw stays per
    frame; the hosts' TCP builds frames of at least 16 KiB on each path, see
    :func:`tso_rtt_log`); ``False`` makes every frame one packet, which the emulator sustains
    up to about 300 Mbit/s in all here. Fixed for the lab's life.
    ``congestion_control``: the hosts' TCP congestion control (``"cubic"``, ``"bbr"``,
    ``"reno"``; ``None`` keeps the kernel's default). ``emulate=False`` joins the hosts with a
    kernel bridge instead of the emulator: rates only (profiles with delay, loss, jitter or
    reordering are refused), at the kernel's speed.

    Raises ``ValueError``/``TypeError`` for bad arguments, :class:`NetLabError` when the lab
    cannot be built (the partial lab is removed first).
    """

    def __init__(
        self,
        hosts: int | Sequence[LinkProfile | str],
        *,
        profile: LinkProfile | str = "lan",
        seed: int | None = 0,
        offload: bool = True,
        congestion_control: str | None = None,
        emulate: bool = True,
    ) -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, (int, Sequence)):
            raise TypeError(f"hosts must be a count or a sequence of profiles, got {hosts!r}")
        if isinstance(hosts, int):
            if not 1 <= hosts <= 200:
                raise ValueError(f"hosts must be between 1 and 200, got {hosts}")
            profiles = [_profile(profile, "profile")] * hosts
        else:
            profiles = [_profile(p, f"hosts[{i}]") for i, p in enumerate(hosts)]
            if not 1 <= len(profiles) <= 200:
                raise ValueError(f"hosts must hold 1 to 200 profiles, got {len(profiles)}")
        if congestion_control is not None and congestion_control not in ("cubic", "bbr", "reno"):
            raise ValueError(
                f"congestion_control must be cubic, bbr or reno, got {congestion_control!r}"
            )
        if not emulate and any(p.emulated for p in profiles):
            raise ValueError("emulate=False takes only rates: the profiles have delay or loss")
        self.name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.core = f"{self.name}-core"
        self.seed = seed
        if not isinstance(offload, bool):
            raise TypeError(f"offload must be True or False, got {offload!r}")
        self.offload = offload
        self.congestion_control = congestion_control
        self.emulate = emulate
        self._hosts = [NetLabHost(self, i) for i in range(len(profiles))]
        for host, host_profile in zip(self._hosts, profiles, strict=True):
            host.profile = host_profile
        self._processes: list[subprocess.Popen[Any]] = []
        self._emulator: subprocess.Popen[bytes] | None = None
        self._emulator_lines = b""
        self._lock = threading.Lock()
        self._cut_paths: set[tuple[int, int]] = set()
        self._state = "new"

    # -- life cycle

    def __enter__(self) -> NetLab:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Build the lab (removing stale labs of dead processes first). Raises
        :class:`NetLabError` if it cannot; whatever was built is removed then."""
        if self._state != "new":
            raise NetLabError(f"the lab is {self._state}: a NetLab starts once")
        reason = unavailable_reason()
        if reason is not None:
            raise NetLabError(reason)
        cleanup_stale()
        self._state = "open"
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kill the processes started in the hosts and the emulator, and delete the
        namespaces (idempotent; also run at interpreter exit)."""
        with self._lock:
            if self._state != "open":
                self._state = "closed"
                return
            self._state = "closing"
        atexit.unregister(self.close)
        for process in self._processes:
            _kill(process)
            for pipe in (process.stdin, process.stdout, process.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        if self._emulator is not None:
            with contextlib.suppress(OSError):
                assert self._emulator.stdin is not None
                self._emulator.stdin.close()
            _kill(self._emulator, grace=1.0)
            if self._emulator.stdout is not None:
                self._emulator.stdout.close()
        errors = []
        for name in [host.netns for host in self._hosts] + [self.core]:
            try:
                _delete_namespace(name)
            except NetLabError as exc:
                errors.append(str(exc))
        self._state = "closed"
        if errors:
            raise NetLabError("; ".join(errors))

    def _check_open(self) -> None:
        if self._state != "open":
            raise NetLabError(f"the lab is {self._state}")

    def _build(self) -> None:
        namespaces = [self.core] + [host.netns for host in self._hosts]
        for name in namespaces:
            _run(["ip", "netns", "add", name])
            self._sysctl(
                name,
                {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"},
            )
        core: list[str] = ["link set lo up"]
        if not self.emulate:
            core += ["link add br0 type bridge", "link set br0 up"]
        for host in self._hosts:
            core.append(
                f"link add {host.core_ifname} type veth peer name eth0 netns {host.netns}"
                f" address {host.mac}"
            )
            if self.emulate:
                core.append(f"link set {host.core_ifname} promisc on")
            else:
                core.append(f"link set {host.core_ifname} master br0")
            core.append(f"link set {host.core_ifname} up")
        _run(["ip", "-n", self.core, "-batch", "-"], input="\n".join(core) + "\n")
        for host in self._hosts:
            commands = [
                "link set lo up",
                f"addr add {host.address}/24 dev eth0",
                "link set eth0 up",
            ]
            if not self.offload:
                commands.append("link set eth0 gso_max_segs 1")
            for other in self._hosts:
                if other is not host:
                    commands.append(
                        f"neigh replace {other.address} lladdr {other.mac} dev eth0 nud permanent"
                    )
            _run(["ip", "-n", host.netns, "-batch", "-"], input="\n".join(commands) + "\n")
            if self.congestion_control is not None:
                self._sysctl(
                    host.netns, {"net.ipv4.tcp_congestion_control": self.congestion_control}
                )
        self._set_tso_rtt_logs()
        if not self.offload:
            _run(
                ["ip", "-n", self.core, "-batch", "-"],
                input="".join(f"link set {h.core_ifname} gso_max_segs 1\n" for h in self._hosts),
            )
        for host in self._hosts:
            self._shape(host)
        if self.emulate:
            self._start_emulator()

    def _set_tso_rtt_logs(self) -> None:
        """Each host's ``tcp_tso_rtt_log`` for its longest path (see :func:`tso_rtt_log`)."""
        if not (
            self.offload and self.emulate and Path("/proc/sys/net/ipv4/tcp_tso_rtt_log").exists()
        ):
            return
        for host in self._hosts:
            longest = max(
                (
                    (host.profile.rtt_s + other.profile.rtt_s) / 2
                    + host.profile.jitter_s
                    + other.profile.jitter_s
                    for other in self._hosts
                    if other is not host
                ),
                default=0.0,
            )
            log = tso_rtt_log(longest)
            if host.tso_rtt_log != log:
                self._sysctl(host.netns, {"net.ipv4.tcp_tso_rtt_log": str(log)})
                host.tso_rtt_log = log

    def _sysctl(self, namespace: str, values: Mapping[str, str]) -> None:
        _run(
            ["ip", "netns", "exec", namespace, "sysctl", "-q", "-w"]
            + [f"{key}={value}" for key, value in values.items()]
        )

    def _shape(self, host: NetLabHost) -> None:
        profile = host.profile
        up = profile.rate_bps
        down = profile.down_rate_bps if profile.down_rate_bps is not None else up
        for namespace, ifname, rate in (
            (host.netns, "eth0", up),
            (self.core, host.core_ifname, down),
        ):
            if rate is None:
                with contextlib.suppress(NetLabError):
                    _run(["tc", "-n", namespace, "qdisc", "del", "dev", ifname, "root"])
                continue
            frame = 65536 + 100 if self.offload else 1600
            burst = max(int(rate / 8 * profile.burst_s), 2 * frame)
            limit = int(rate / 8 * profile.queue_s) + burst
            _run(
                [
                    *("tc", "-n", namespace, "qdisc", "replace", "dev", ifname, "root", "tbf"),
                    *("rate", f"{int(rate)}bit", "burst", str(burst), "limit", str(limit)),
                ]
            )

    # -- the emulator

    def _start_emulator(self) -> None:
        config = {
            "seed": self.seed,
            "hosts": [
                {
                    "ifname": host.core_ifname,
                    "mac": host.mac,
                    "up": host.profile.hop(),
                    "down": host.profile.hop(),
                }
                for host in self._hosts
            ],
        }
        self._emulator = subprocess.Popen(  # noqa: S603 (this interpreter, our own script)
            ["ip", "netns", "exec", self.core, sys.executable, "-I", str(EMULATOR)],  # noqa: S607
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        answer = self._ask(config)
        if not answer.get("ready"):
            raise NetLabError(f"the link emulator did not start: {answer.get('error')}")

    def _ask(self, request: Mapping[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        emulator = self._emulator
        if emulator is None:
            raise NetLabError("this lab has no emulator (emulate=False)")
        assert emulator.stdin is not None and emulator.stdout is not None
        try:
            emulator.stdin.write(json.dumps(request).encode() + b"\n")
            emulator.stdin.flush()
        except OSError as exc:
            raise NetLabError(f"the link emulator is gone: {exc}") from exc
        deadline = time.monotonic() + timeout
        fd = emulator.stdout.fileno()
        while b"\n" not in self._emulator_lines:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NetLabError(f"the link emulator did not answer {request} in {timeout} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise NetLabError(f"the link emulator exited ({emulator.poll()})")
                self._emulator_lines += chunk
        line, self._emulator_lines = self._emulator_lines.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        if not answer.get("ok"):
            raise NetLabError(f"the link emulator refused {request}: {answer.get('error')}")
        return answer

    # -- using the lab

    @property
    def hosts(self) -> Sequence[NetLabHost]:
        """The hosts, in order (host ``i`` has address ``10.77.0.<i+1>``)."""
        return tuple(self._hosts)

    def host(self, index: int) -> NetLabHost:
        """Host ``index`` (``IndexError`` if there is none)."""
        return self._hosts[index]

    def set_link(self, index: int, up: bool) -> None:
        """Cut or restore host ``index``'s link (see :meth:`NetLabHost.set_link`)."""
        self._check_open()
        host = self._hosts[index]
        if self.emulate:
            with self._lock:
                self._ask({"op": "link", "host": index, "up": bool(up)})
        else:
            state = "up" if up else "down"
            _run(["ip", "-n", self.core, "link", "set", host.core_ifname, state])

    def set_path(self, a: int, b: int, up: bool) -> None:
        """Cut (``False``) or restore (``True``) the path between hosts ``a`` and ``b``, both
        ways: while it is cut every frame between the two is lost (those on the way too), and
        each still reaches every other host. Needs the emulator (``emulate=True``). Raises
        ``IndexError`` for a host that does not exist, ``ValueError`` if ``a == b``."""
        self._check_open()
        for index in (a, b):
            self._hosts[index]  # (IndexError for a host that does not exist)
        if a == b:
            raise ValueError(f"set_path needs two different hosts, got {a} twice")
        with self._lock:
            self._ask({"op": "path", "hosts": [a, b], "up": bool(up)})
            pair = (min(a, b), max(a, b))
            if up:
                self._cut_paths.discard(pair)
            else:
                self._cut_paths.add(pair)

    def partition(self, *groups: Sequence[int]) -> None:
        """Split the lab: cut every path between hosts of different ``groups`` (a host in no
        group keeps every path). ``partition()`` with no groups heals every cut path. Hosts'
        own links (:meth:`set_link`) are left as they are. Raises ``ValueError`` if a host is
        in two groups."""
        self._check_open()
        seen: set[int] = set()
        for group in groups:
            for index in group:
                self._hosts[index]  # (IndexError)
                if index in seen:
                    raise ValueError(f"partition: host {index} is in two groups")
                seen.add(index)
        with self._lock:
            for a, b in sorted(self._cut_paths):
                self._ask({"op": "path", "hosts": [a, b], "up": True})
            self._cut_paths.clear()
            for i, first in enumerate(groups):
                for second in groups[i + 1 :]:
                    for a in first:
                        for b in second:
                            self._ask({"op": "path", "hosts": [a, b], "up": False})
                            self._cut_paths.add((min(a, b), max(a, b)))

    def set_profile(self, index: int, profile: LinkProfile | str) -> None:
        """Change host ``index``'s link to ``profile`` while the lab runs (rates at once,
        delay and loss for frames that arrive from now on)."""
        self._check_open()
        new = _profile(profile, "profile")
        if not self.emulate and new.emulated:
            raise ValueError("emulate=False takes only rates: the profile has delay or loss")
        host = self._hosts[index]
        host.profile = new
        self._shape(host)
        self._set_tso_rtt_logs()
        if self.emulate:
            with self._lock:
                self._ask({"op": "set", "host": index, "up": new.hop(), "down": new.hop()})

    def stats(self) -> list[dict[str, int]]:
        """The emulator's counters per host (as the source of the frames): ``rx_frames``,
        ``rx_bytes``, ``tx_frames``, ``tx_bytes``, ``lost`` (emulated loss, in packets),
        ``link_drops`` (link cut), ``queue_drops`` (download queue full), ``held_drops``
        (emulator memory bound), ``reordered``, ``socket_drops`` (frames the emulator was too
        slow to read: a non-zero value means the emulator, not the profile, limited the run)."""
        self._check_open()
        with self._lock:
            hosts: list[dict[str, int]] = self._ask({"op": "stats"})["hosts"]
        return hosts
