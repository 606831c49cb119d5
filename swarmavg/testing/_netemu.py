"""The network lab's link emulator (a userspace ``netem``): one process in the lab's core
namespace that is the switch between the hosts.

Run by :class:`swarmavg.testing.netlab.NetLab` as ``python _netemu.py`` (by path: it imports
nothing but the standard library, so it runs whatever ``sys.path`` the namespace gives it).

Each host's veth pair ends in the core namespace; the emulator holds one ``AF_PACKET`` socket per
core end, with virtio-net headers on (``PACKET_VNET_HDR``), so a TCP segmentation-offload frame
(up to 64 KiB) travels as one frame, checksum offload and all, and the kernel segments it where
it must. A frame read from host ``i`` (its upload) is forwarded to the host that owns its
destination MAC (or to every other host for a broadcast), after:

- **loss**: each of its segments (wire packets) is lost with host ``i``'s uplink's and host
  ``j``'s downlink's probability; a TCP/IPv4 offload frame with lost segments is cut into the
  runs of segments kept, each made a frame as the kernel's segmentation would have made it (IP
  length, id and header checksum, TCP sequence number, flags, partial checksum), so offload
  frames lose single packets like a real path; any other frame with a lost segment is lost
  whole (``lost`` counts segments);
- **delay and jitter**: held for ``delay_up[i] + delay_down[j]``, each hop's delay drawn
  uniformly in ``delay ± jitter/2`` (never below 0); frames between a pair leave in order
  (a frame is never sent before the previous one of its pair) unless **reordered**: each
  segment is, with the two hops' ``reorder`` probability, taken half the delay and sent ahead
  of the queue; a TCP/IPv4 offload frame with such segments is cut like one with losses (the
  segment overtakes alone, the runs around it keep their place), any other frame overtakes
  whole.

Rates are not the emulator's job: ``tc`` ``tbf`` shapes each host's upload (on the host's end of
its veth) and download (on the core end, which the emulator sends through, so a full download
queue drops the frame like a router would: counted as ``queue_drops``).

A host whose link is down loses every frame from or to it, including frames already held; a
pair of hosts whose path is cut (a partition) loses every frame between the two, the same way,
while each keeps reaching the others.

Control: JSON lines on stdin, one answer a line on stdout (``{"ok": true, ...}`` or
``{"ok": false, "error": ...}``):

- the first line configures: ``{"hosts": [{"ifname", "mac", "up": HOP, "down": HOP}], "seed",
  "max_held_bytes"}`` where ``HOP`` is ``{"delay", "jitter", "loss", "reorder"}`` (seconds and
  probabilities); answered ``{"ok": true, "ready": true}`` once every socket is bound;
- ``{"op": "set", "host": i, "up": HOP, "down": HOP}``, ``{"op": "link", "host": i, "up": bool}``,
  ``{"op": "path", "hosts": [i, j], "up": bool}`` (the path between two hosts, both ways),
  ``{"op": "stats"}`` (counters per host), ``{"op": "exit"}``.

The process exits when stdin closes (its owner died) and on ``exit``.
"""

from __future__ import annotations

import errno
import heapq
import json
import math
import os
import random
import select
import socket
import struct
import sys
import time
from typing import Any

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_STATISTICS = 6
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
VNET_HDR_LEN = 10
VNET_HDR = struct.Struct("=BBHHHH")  # flags, gso_type, hdr_len, gso_size, csum_start, csum_off
NEEDS_CSUM = 1  # virtio-net header flag: the checksum is partial
GSO_TCPV4 = 1
GSO_ECN = 0x80
TCP_FIN, TCP_PSH, TCP_CWR = 0x01, 0x08, 0x80
HEADERS_GUESS = 14 + 20 + 32  # Ethernet + IPv4 + TCP with timestamps: only to count segments
BATCH = 256  # frames read from one socket per wake-up (bounded work per turn)
SOCKET_BUFFER = 8 << 20
SO_SNDBUFFORCE = 32
SO_RCVBUFFORCE = 33


class Hop:
    """One direction of one host's access link."""

    __slots__ = ("delay", "jitter", "loss", "reorder")

    def __init__(self, spec: dict[str, Any]) -> None:
        self.delay = float(spec.get("delay", 0.0))
        self.jitter = float(spec.get("jitter", 0.0))
        self.loss = float(spec.get("loss", 0.0))
        self.reorder = float(spec.get("reorder", 0.0))
        if not (self.delay >= 0 and self.jitter >= 0):
            raise ValueError("delay and jitter must be >= 0")
        if not (0 <= self.loss <= 1 and 0 <= self.reorder <= 1):
            raise ValueError("loss and reorder must be probabilities")


class Host:
    __slots__ = ("counters", "down", "ifname", "index", "link_up", "mac", "sock", "up")

    def __init__(self, index: int, spec: dict[str, Any]) -> None:
        self.index = index
        self.ifname = str(spec["ifname"])
        self.mac = bytes.fromhex(str(spec["mac"]).replace(":", ""))
        self.up = Hop(spec.get("up", {}))
        self.down = Hop(spec.get("down", {}))
        self.link_up = True
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        for option in (SO_RCVBUFFORCE, SO_SNDBUFFORCE):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        sock.bind((self.ifname, ETH_P_ALL))
        sock.setblocking(False)
        self.sock = sock
        self.counters = dict.fromkeys(
            (
                "rx_frames",
                "rx_bytes",
                "tx_frames",
                "tx_bytes",
                "lost",
                "link_drops",
                "queue_drops",
                "held_drops",
                "reordered",
                "socket_drops",
            ),
            0,
        )

    def socket_drops(self) -> int:
        """Frames the kernel dropped because the emulator did not read them in time (since the
        last call: the kernel resets the counter on read)."""
        raw = self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8)
        drops: int = struct.unpack("=II", raw)[1]
        return drops


def tcp4_layout(frame: bytes) -> tuple[int, int, int] | None:
    """``(TCP header offset, payload offset, segment size)`` of a TCP/IPv4 segmentation-offload
    frame (with its virtio-net header) that :func:`cut` can cut, or ``None`` for any other frame
    (not TCP/IPv4, not offloaded, no partial checksum, truncated)."""
    if len(frame) < VNET_HDR_LEN + 14 + 40:
        return None
    flags, gso_type, _hdr_len, gso_size, _start, _offset = VNET_HDR.unpack_from(frame)
    if gso_type & ~GSO_ECN != GSO_TCPV4 or not gso_size or not flags & NEEDS_CSUM:
        return None
    ip = VNET_HDR_LEN + 14
    if frame[ip - 2 : ip] != b"\x08\x00" or frame[ip] >> 4 != 4 or frame[ip + 9] != 6:
        return None
    tcp = ip + (frame[ip] & 0x0F) * 4
    if tcp + 20 > len(frame):
        return None
    payload = tcp + (frame[tcp + 12] >> 4) * 4
    if tcp - ip < 20 or payload - tcp < 20 or payload > len(frame):
        return None
    return tcp, payload, gso_size


def segments(frame: bytes, layout: tuple[int, int, int] | None = None) -> int:
    """How many wire packets a (possibly GSO) frame with its virtio-net header stands for
    (exact for TCP/IPv4 given its ``layout``; other offloaded frames guess their headers)."""
    if layout is not None:
        return max(1, -(-(len(frame) - layout[1]) // layout[2]))
    fields: tuple[int, ...] = VNET_HDR.unpack_from(frame)
    gso_type, gso_size = fields[1], fields[3]
    if gso_type == 0 or gso_size == 0:
        return 1
    payload = len(frame) - VNET_HDR_LEN - HEADERS_GUESS
    return max(1, -(-payload // gso_size))


def _fold(total: int) -> int:
    while total > 0xFFFF:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def cut(frame: bytes, layout: tuple[int, int, int], first: int, end: int, count: int) -> bytes:
    """Segments ``first`` to ``end - 1`` (of ``count``) of the TCP/IPv4 offload frame
    ``frame`` (``layout`` from :func:`tcp4_layout`) as a frame of their own, as the kernel's
    segmentation would have made them: IPv4 length, id and header checksum, TCP sequence number
    and partial checksum set for the part; CWR only on the first segment, FIN and PSH only on
    the last; an offload frame while the part has more than one segment."""
    tcp, payload, mss = layout
    ip = VNET_HDR_LEN + 14
    body = frame[payload + first * mss : payload + end * mss]
    head = bytearray(frame[:payload])
    if len(body) <= mss:  # one packet: no segmentation left to do (the checksum still is)
        head[1:2] = b"\0"
        head[4:6] = b"\0\0"
    tcp_length = payload - tcp + len(body)
    packet_id = (int.from_bytes(head[ip + 4 : ip + 6], "big") + first) & 0xFFFF
    struct.pack_into("!HH", head, ip + 2, tcp - ip + tcp_length, packet_id)
    head[ip + 10 : ip + 12] = b"\0\0"
    words = struct.unpack_from(f"!{(tcp - ip) // 2}H", head, ip)
    struct.pack_into("!H", head, ip + 10, ~_fold(sum(words)) & 0xFFFF)
    seq = (int.from_bytes(head[tcp + 4 : tcp + 8], "big") + first * mss) & 0xFFFFFFFF
    struct.pack_into("!I", head, tcp + 4, seq)
    if first:
        head[tcp + 13] &= ~TCP_CWR & 0xFF
    if end < count:
        head[tcp + 13] &= ~(TCP_FIN | TCP_PSH) & 0xFF
    # a partial checksum holds the pseudo-header's sum (the device adds the rest)
    pseudo = sum(struct.unpack_from("!4H", head, ip + 12)) + 6 + tcp_length
    struct.pack_into("!H", head, tcp + 16, _fold(pseudo))
    return bytes(head) + body


class Emulator:
    def __init__(self, config: dict[str, Any]) -> None:
        self.rng = random.Random(config.get("seed"))
        self.max_held = int(config.get("max_held_bytes", 128 << 20))
        self.hosts = [Host(i, spec) for i, spec in enumerate(config["hosts"])]
        self.by_mac = {host.mac: host for host in self.hosts}
        self.by_fd = {host.sock.fileno(): host for host in self.hosts}
        # (due, seq, source index, destination, frame)
        self.held: list[tuple[float, int, int, Host, bytes]] = []
        self.held_bytes = 0
        self.seq = 0
        self.last_due: dict[tuple[int, int], float] = {}
        #: pairs of host indices (lower first) whose path is cut
        self.cut_paths: set[tuple[int, int]] = set()
        self.stdin_buffer = b""
        self.running = True

    # -- forwarding

    def hop_delay(self, hop: Hop) -> float:
        if hop.jitter:
            return max(0.0, hop.delay + (self.rng.random() - 0.5) * hop.jitter)
        return hop.delay

    def receive(self, source: Host, now: float) -> None:
        for _ in range(BATCH):
            try:
                frame = source.sock.recv(65536 + VNET_HDR_LEN + 64)
            except BlockingIOError:
                return
            except OSError as exc:  # (the link went away under us: ENETDOWN and the like)
                if exc.errno in (errno.ENETDOWN, errno.ENXIO, errno.ENODEV):
                    return
                raise
            source.counters["rx_frames"] += 1
            source.counters["rx_bytes"] += len(frame) - VNET_HDR_LEN
            if len(frame) < VNET_HDR_LEN + 14:
                continue
            dst = frame[VNET_HDR_LEN : VNET_HDR_LEN + 6]
            if dst[0] & 1:  # broadcast or multicast: to every other host
                targets = [h for h in self.hosts if h is not source]
            else:
                target = self.by_mac.get(dst)
                if target is None or target is source:
                    continue
                targets = [target]
            for target in targets:
                self.forward(source, target, frame, now)

    def path_cut(self, source: Host, target: Host) -> bool:
        """Whether the path between the two is cut (their links are not looked at)."""
        i, j = source.index, target.index
        return (i, j) in self.cut_paths if i < j else (j, i) in self.cut_paths

    def forward(self, source: Host, target: Host, frame: bytes, now: float) -> None:
        if not (source.link_up and target.link_up) or (
            self.cut_paths and self.path_cut(source, target)
        ):
            source.counters["link_drops"] += 1
            return
        up, down = source.up, target.down
        reorder = up.reorder + down.reorder
        if not (up.loss or down.loss or reorder):
            self.hold(source, target, frame, now, reordered=False)
            return
        # (most frames are one packet, ACKs among them: parse only offload frames)
        layout = tcp4_layout(frame) if frame[1] else None
        count = segments(frame, layout)
        runs = [(0, count)]
        if up.loss or down.loss:
            kept = (1.0 - up.loss) * (1.0 - down.loss)
            if self.rng.random() >= kept**count:  # at least one segment is lost
                runs = self.lost_segments(1.0 - kept, count)
                if layout is None or not runs:  # (a frame it cannot cut is lost whole)
                    source.counters["lost"] += count
                    return
                source.counters["lost"] += count - sum(end - first for first, end in runs)
        for first, end in runs:
            pieces = [(first, end, False)]
            if reorder and self.rng.random() >= (1.0 - reorder) ** (end - first):
                if layout is None:  # (a frame it cannot cut overtakes whole)
                    pieces = [(first, end, True)]
                else:
                    pieces = self.reordered_pieces(reorder, first, end)
            for start, stop, reordered in pieces:
                if layout is None or (start, stop) == (0, count):
                    part = frame
                else:
                    part = cut(frame, layout, start, stop, count)
                self.hold(source, target, part, now, reordered=reordered)

    def picked(self, probability: float, count: int) -> list[int]:
        """The indices (ascending) of ``count`` segments each picked with ``probability``,
        given that at least one is."""
        keep = 1.0 - probability
        if keep <= 0.0:
            return list(range(count))
        # the first picked segment, drawn from its distribution given that there is one
        at_least_one = 1.0 - keep**count
        first = math.floor(math.log1p(-self.rng.random() * at_least_one) / math.log1p(-probability))
        first = min(max(first, 0), count - 1)
        return [first] + [i for i in range(first + 1, count) if self.rng.random() < probability]

    def lost_segments(self, loss: float, count: int) -> list[tuple[int, int]]:
        """The runs ``(first, end)`` of the ``count`` segments of a frame that are kept, each
        segment lost with probability ``loss``, given that at least one is."""
        runs = []
        start = 0
        for index in self.picked(loss, count):
            if index > start:
                runs.append((start, index))
            start = index + 1
        if start < count:
            runs.append((start, count))
        return runs

    def reordered_pieces(self, reorder: float, first: int, end: int) -> list[tuple[int, int, bool]]:
        """Segments ``first`` to ``end - 1`` as pieces ``(first, end, reordered)`` in their
        order: each segment reordered with probability ``reorder`` (one piece each), given that
        at least one is; the runs between them stay whole."""
        pieces = []
        start = first
        for index in self.picked(reorder, end - first):
            index += first
            if index > start:
                pieces.append((start, index, False))
            pieces.append((index, index + 1, True))
            start = index + 1
        if start < end:
            pieces.append((start, end, False))
        return pieces

    def hold(
        self, source: Host, target: Host, frame: bytes, now: float, *, reordered: bool
    ) -> None:
        """Send ``frame`` after its delay (at once if it has none and nothing is held);
        ``reordered``: after half of it, ahead of the pair's queue."""
        up, down = source.up, target.down
        if self.held_bytes + len(frame) > self.max_held:
            source.counters["held_drops"] += 1
            return
        delay = self.hop_delay(up) + self.hop_delay(down)
        pair = (source.index, target.index)
        if reordered:
            due = now + delay / 2
            source.counters["reordered"] += 1
        else:
            due = max(now + delay, self.last_due.get(pair, 0.0))
            self.last_due[pair] = due
        if due <= now and not self.held:
            self.send(source.index, target, frame)
            return
        self.seq += 1
        heapq.heappush(self.held, (due, self.seq, source.index, target, frame))
        self.held_bytes += len(frame)

    def send(self, source: int, target: Host, frame: bytes) -> None:
        counters = self.hosts[source].counters
        if not target.link_up or (self.cut_paths and self.path_cut(self.hosts[source], target)):
            counters["link_drops"] += 1
            return
        try:
            target.sock.send(frame)
        except (BlockingIOError, OSError) as exc:
            # ENOBUFS: the download queue (tbf) is full; EAGAIN: the socket buffer; ENETDOWN
            counters["queue_drops"] += 1
            if not isinstance(exc, BlockingIOError) and exc.errno not in (
                errno.ENOBUFS,
                errno.ENETDOWN,
                errno.ENXIO,
                errno.EMSGSIZE,
            ):
                raise
            return
        counters["tx_frames"] += 1
        counters["tx_bytes"] += len(frame) - VNET_HDR_LEN

    def release(self, now: float) -> None:
        held = self.held
        while held and held[0][0] <= now:
            _due, _seq, source, target, frame = heapq.heappop(held)
            self.held_bytes -= len(frame)
            self.send(source, target, frame)

    # -- control

    def control(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "set":
            host = self.hosts[int(request["host"])]
            if "up" in request:
                host.up = Hop(request["up"])
            if "down" in request:
                host.down = Hop(request["down"])
            return {"ok": True}
        if op == "link":
            host = self.hosts[int(request["host"])]
            host.link_up = bool(request["up"])
            if not host.link_up:  # the cable is cut: what was on it is gone
                kept = []
                for item in self.held:
                    if item[3] is host or self.hosts[item[2]] is host:
                        self.hosts[item[2]].counters["link_drops"] += 1
                        self.held_bytes -= len(item[4])
                    else:
                        kept.append(item)
                heapq.heapify(kept)
                self.held = kept
            return {"ok": True}
        if op == "path":
            a, b = sorted(int(i) for i in request["hosts"])
            if a == b or a < 0 or b >= len(self.hosts):
                return {"ok": False, "error": f"path: bad hosts {request['hosts']!r}"}
            if request["up"]:
                self.cut_paths.discard((a, b))
            else:  # (frames on their way between the two are gone too)
                self.cut_paths.add((a, b))
                ends = {a, b}
                kept = []
                for item in self.held:
                    if {item[2], item[3].index} == ends:
                        self.hosts[item[2]].counters["link_drops"] += 1
                        self.held_bytes -= len(item[4])
                    else:
                        kept.append(item)
                heapq.heapify(kept)
                self.held = kept
            return {"ok": True}
        if op == "stats":
            for host in self.hosts:
                host.counters["socket_drops"] += host.socket_drops()
            return {
                "ok": True,
                "hosts": [dict(host.counters) for host in self.hosts],
                "held_bytes": self.held_bytes,
            }
        if op == "exit":
            self.running = False
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def read_control(self) -> None:
        chunk = os.read(0, 65536)
        if not chunk:
            self.running = False
            return
        self.stdin_buffer += chunk
        while b"\n" in self.stdin_buffer:
            line, self.stdin_buffer = self.stdin_buffer.split(b"\n", 1)
            try:
                answer = self.control(json.loads(line))
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            say(answer)

    def run(self) -> None:
        fds = [0, *self.by_fd]
        while self.running:
            now = time.monotonic()
            self.release(now)
            timeout = None if not self.held else max(0.0, self.held[0][0] - now)
            readable, _, _ = select.select(fds, [], [], timeout)
            now = time.monotonic()
            for fd in readable:
                if fd == 0:
                    self.read_control()
                else:
                    self.receive(self.by_fd[fd], now)


def say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> int:
    pending = b""
    while b"\n" not in pending:
        chunk = os.read(0, 65536)
        if not chunk:
            return 0
        pending += chunk
    line, rest = pending.split(b"\n", 1)
    try:
        emulator = Emulator(json.loads(line))
    except (ValueError, KeyError, TypeError, OSError) as exc:
        say({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    emulator.stdin_buffer = rest
    say({"ok": True, "ready": True})
    try:
        emulator.run()
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
