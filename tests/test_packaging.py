"""The distributions released together keep one version and pin each other to it."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import swarmavg_tcp

ROOT = Path(__file__).resolve().parent.parent


def _project(path: Path) -> dict[str, object]:
    with path.open("rb") as f:
        project = tomllib.load(f)["project"]
    assert isinstance(project, dict)
    return project


def test_lockstep_versions() -> None:
    core = _project(ROOT / "pyproject.toml")
    tcp = _project(ROOT / "transports" / "tcp" / "pyproject.toml")
    version = core["version"]
    assert tcp["version"] == version
    assert f"swarmavg-tcp=={version}" in core["dependencies"]  # type: ignore[operator]
    assert f"swarmavg=={version}" in tcp["dependencies"]  # type: ignore[operator]
    assert swarmavg_tcp.__version__ == version
    quic = _project(ROOT / "transports" / "quic" / "pyproject.toml")
    assert quic["version"] == version
    assert f"swarmavg=={version}" in quic["dependencies"]  # type: ignore[operator]


def test_tcp_entry_point_is_registered() -> None:
    points = importlib.metadata.entry_points(group="swarmavg.transports")
    assert {p.name: p.value for p in points}["tcp"] == "swarmavg_tcp:TcpTransport"


def test_quic_entry_point_and_extra() -> None:
    points = importlib.metadata.entry_points(group="swarmavg.transports")
    assert {p.name: p.value for p in points}["quic"] == "swarmavg_quic:QuicTransport"
    version = _project(ROOT / "pyproject.toml")["version"]
    extras = _project(ROOT / "pyproject.toml")["optional-dependencies"]
    assert extras["quic"] == [f"swarmavg-quic=={version}"]  # type: ignore[index]
