"""What the fuzz harnesses share: the command line, the crash folder, libFuzzer's arguments."""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def arg_parser(description: str, reproduce_help: str) -> argparse.ArgumentParser:
    """The options every harness takes (unknown ones go to libFuzzer with ``--engine atheris``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to fuzz")
    parser.add_argument("--engine", choices=["hypothesis", "atheris"], default="hypothesis")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis: reproducible run")
    parser.add_argument("--corpus", type=Path, default=None, help="atheris: corpus directory")
    parser.add_argument("--reproduce", type=Path, default=None, help=reproduce_help)
    return parser


def crash_dir() -> Path:
    """``fuzz/crashes/`` (git-ignored), created if needed."""
    crashes = ROOT / "fuzz" / "crashes"
    crashes.mkdir(exist_ok=True)
    return crashes


def libfuzzer_args(argv0: str, seconds: float, extra: list[str], corpus: Path) -> list[str]:
    """``atheris.Setup`` arguments: a time limit, crashes to ``fuzz/crashes/``, 4 GiB RSS."""
    return [
        argv0,
        f"-max_total_time={int(seconds)}",
        f"-artifact_prefix={crash_dir()}/",
        "-rss_limit_mb=4096",
        *extra,
        str(corpus),
    ]
