"""The link emulator's cutting of offload frames (no lab needed): a TCP/IPv4 frame of several
segments cut as the kernel would have segmented it, and losses drawn per segment."""

from __future__ import annotations

import itertools
import random
import struct

from swarmavg.testing import _netemu

MSS = 1448
SRC, DST = bytes([10, 77, 0, 1]), bytes([10, 77, 0, 2])


def _frame(payload: bytes, flags: int, packet_id: int = 0xFFFE, seq: int = 0xFFFFFF00) -> bytes:
    """A TCP/IPv4 offload frame as a packet socket reads it (virtio-net header first)."""
    options = b"\x01\x01\x08\x0a" + bytes(8)  # NOP NOP timestamps
    tcp = struct.pack("!HHIIBBHHH", 1000, 2000, seq, 5, 8 << 4, flags, 500, 0, 0) + options
    ip = struct.pack(
        "!BBHHHBBH4s4s",
        0x45,
        0,
        20 + len(tcp) + len(payload),
        packet_id,
        0x4000,
        64,
        6,
        0,
        SRC,
        DST,
    )
    vnet = _netemu.VNET_HDR.pack(_netemu.NEEDS_CSUM, _netemu.GSO_TCPV4, 66, MSS, 34, 16)
    ethernet = bytes.fromhex("0277000000020277000000010800")
    return vnet + ethernet + ip + tcp + payload


def _checksum(data: bytes) -> int:
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total > 0xFFFF:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def test_a_cut_part_is_the_segments_the_kernel_would_have_sent() -> None:
    payload = bytes(range(256)) * 30  # 7680 bytes: 6 segments, the last one short
    frame = _frame(payload, flags=0x80 | 0x18 | 0x01)  # CWR, ACK, PSH, FIN
    layout = _netemu.tcp4_layout(frame)
    assert layout == (10 + 14 + 20, 10 + 14 + 20 + 32, MSS)
    assert _netemu.segments(frame, layout) == 6

    middle = _netemu.cut(frame, layout, 2, 4, 6)
    ip, tcp = 24, 44
    vnet = _netemu.VNET_HDR.unpack_from(middle)
    assert vnet == (_netemu.NEEDS_CSUM, _netemu.GSO_TCPV4, 66, MSS, 34, 16)
    assert middle[tcp + 32 :] == payload[2 * MSS : 4 * MSS]
    total_length, packet_id = struct.unpack_from("!HH", middle, ip + 2)
    assert (total_length, packet_id) == (52 + 2 * MSS, 0)  # the id counts segments, wrapping
    assert _checksum(middle[ip:tcp]) == 0xFFFF  # a valid IP header checksum
    assert struct.unpack_from("!I", middle, tcp + 4)[0] == (0xFFFFFF00 + 2 * MSS) & 0xFFFFFFFF
    assert middle[tcp + 13] == 0x10  # ACK only: CWR stays on the first, FIN and PSH on the last
    pseudo = _checksum(SRC + DST + struct.pack("!HH", 6, 32 + 2 * MSS))
    assert struct.unpack_from("!H", middle, tcp + 16)[0] == pseudo

    last = _netemu.cut(frame, layout, 5, 6, 6)  # one short segment: no offload left
    vnet = _netemu.VNET_HDR.unpack_from(last)
    assert (vnet[0], vnet[1], vnet[3]) == (_netemu.NEEDS_CSUM, 0, 0)
    assert last[tcp + 32 :] == payload[5 * MSS :]
    assert last[tcp + 13] == 0x19  # ACK, PSH, FIN
    first = _netemu.cut(frame, layout, 0, 1, 6)
    assert first[tcp + 13] == 0x90  # CWR, ACK
    assert _netemu.tcp4_layout(first) is None  # (one packet: nothing left to cut)


def test_only_tcp4_offload_frames_are_cut() -> None:
    frame = bytearray(_frame(bytes(4000), flags=0x10))
    assert _netemu.tcp4_layout(bytes(frame)) is not None
    udp = bytearray(frame)
    udp[24 + 9] = 17
    no_checksum = bytearray(frame)
    no_checksum[0] = 0
    truncated = bytes(frame[:60])
    for other in (bytes(udp), bytes(no_checksum), truncated):
        assert _netemu.tcp4_layout(other) is None


def test_each_segment_is_lost_with_the_links_probability() -> None:
    """The emulator draws "a segment of the frame is lost" at once, then which ones given that:
    every position must end up lost with the per-packet probability, independently."""
    emulator = _netemu.Emulator.__new__(_netemu.Emulator)
    emulator.rng = random.Random(5)
    loss, count, frames = 0.1, 8, 20_000
    lost = [0] * count
    pairs = 0  # frames losing both segment 0 and segment 1
    for _ in range(frames):
        if emulator.rng.random() < (1 - loss) ** count:
            continue
        kept = emulator.lost_segments(loss, count)
        gone = set(range(count)) - {i for first, end in kept for i in range(first, end)}
        assert gone  # given that one is lost
        for index in gone:
            lost[index] += 1
        pairs += {0, 1} <= gone
    for count_at in lost:
        assert abs(count_at / frames - loss) < 0.01
    assert abs(pairs / frames - loss * loss) < 0.004


def test_each_segment_overtakes_with_the_paths_probability_and_alone() -> None:
    """Reordering is drawn per segment like loss: a reordered segment of an offload frame is a
    piece of its own (it overtakes alone), the runs around it stay whole and in order, and every
    position is reordered with the per-packet probability."""
    emulator = _netemu.Emulator.__new__(_netemu.Emulator)
    emulator.rng = random.Random(11)
    reorder, first, end, frames = 0.1, 2, 10, 20_000
    count = end - first
    reordered = [0] * count
    for _ in range(frames):
        if emulator.rng.random() < (1 - reorder) ** count:
            continue
        pieces = emulator.reordered_pieces(reorder, first, end)
        # the pieces cover the segments once, in order; reordered ones are single segments
        assert pieces[0][0] == first
        assert pieces[-1][1] == end
        assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
        assert any(flag for _a, _b, flag in pieces)
        for start, stop, flag in pieces:
            assert stop > start
            if flag:
                assert stop == start + 1
                reordered[start - first] += 1
        for a, b in itertools.pairwise(pieces):  # runs kept are whole
            assert a[2] or b[2]
    for count_at in reordered:
        assert abs(count_at / frames - reorder) < 0.01
