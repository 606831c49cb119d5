"""``examples/accumulator.py --peers 3``: moolib's example loop trains the workload among three
peer processes over TCP on loopback; bounded by ``--rounds``. They must all end at that model
version with the same parameters (bit for bit: the digests the peers print), the loss must
fall, and the script must exit 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

EXAMPLE = Path(__file__).parents[2] / "examples" / "accumulator.py"
ROUNDS = 12
FINAL = re.compile(
    r"\[peer (\d)\] final: version (\d+), loss ([\d.]+) -> ([\d.]+), params sha256 ([0-9a-f]+)"
)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_example_trains_three_peers_to_one_model() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--peers",
            "3",
            "--rounds",
            str(ROUNDS),
            "--report-every",
            "6",
            "--linger",
            "0.5",
            "--max-seconds",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=140,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    finals = {int(m[1]): m for m in FINAL.finditer(done.stdout)}
    assert sorted(finals) == [0, 1, 2], out[-4000:]
    assert {int(m[2]) for m in finals.values()} == {ROUNDS}
    assert len({m[5] for m in finals.values()}) == 1  # equal parameters
    for m in finals.values():
        initial, final = float(m[3]), float(m[4])
        assert initial > 5.0  # (near ln 256: an untrained model)
        assert final < initial - 1.0  # 12 Adam steps of 48 samples: ~3.7 measured
    assert "3 peers ended at version(s) [12], equal parameters" in done.stdout
    assert "version 6: loss" in done.stdout  # (a line every 6 results)
