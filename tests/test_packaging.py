"""The distributions released together keep one version and pin each other to it."""

from __future__ import annotations

import ast
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


def test_the_oldest_session_installs_the_declared_lower_bounds() -> None:
    """``nox -s oldest`` tests the lower bounds that pyproject.toml declares: every bound of a
    dependency it pins is the version it installs (a bound raised, or lowered, without the
    session following would leave the declared range untested)."""
    source = (ROOT / "noxfile.py").read_text()
    start = source.index("OLDEST = {") + len("OLDEST = ")
    oldest = ast.literal_eval(source[start : source.index("}", start) + 1])
    assert isinstance(oldest, dict)
    bounds: dict[str, set[str]] = {}
    for path in ("pyproject.toml", "transports/tcp/pyproject.toml"):
        for requirement in _project(ROOT / path)["dependencies"]:  # type: ignore[attr-defined]
            name, _, bound = requirement.partition(">=")
            if bound:
                bounds.setdefault(name.strip(), set()).add(bound.split(",")[0].strip())
    for name, version in oldest.items():
        assert name in bounds, name
        for bound in bounds[name]:
            assert version.split(".")[: len(bound.split("."))] == bound.split("."), (name, bound)
    assert {"anyio", "msgpack", "cryptography", "numpy"} <= set(oldest)
