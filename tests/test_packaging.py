"""Packaging: one distribution that carries the transports as plug-ins.

``pip install swarmavg`` (or ``pip install .`` / ``-e .`` from a clone) gives a working TCP swarm:
the packages ``swarmavg_tcp`` and ``swarmavg_quic`` ship in swarmavg's wheel and are found, like a
third party's transport, through the ``swarmavg.transports`` entry points, never imported by
swarmavg's own code. ``nox -s install`` installs a fresh clone into fresh venvs and runs a swarm.
"""

from __future__ import annotations

import ast
import importlib.metadata
import tomllib
from collections.abc import Iterator
from pathlib import Path

import swarmavg
import swarmavg_quic
import swarmavg_tcp

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _project() -> dict[str, object]:
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    return project


def test_one_version() -> None:
    version = _project()["version"]
    assert swarmavg.__version__ == version
    assert swarmavg_tcp.__version__ == version
    assert swarmavg_quic.__version__ == version
    assert importlib.metadata.version("swarmavg") == version


def test_the_transports_are_registered_by_swarmavg_itself() -> None:
    points = {p.name: p for p in importlib.metadata.entry_points(group="swarmavg.transports")}
    assert points["tcp"].value == "swarmavg_tcp:TcpTransport"
    assert points["quic"].value == "swarmavg_quic:QuicTransport"
    for name in ("tcp", "quic"):
        dist = points[name].dist
        assert dist is not None
        assert dist.name == "swarmavg"
    declared = _project()["entry-points"]
    assert isinstance(declared, dict)
    assert declared["swarmavg.transports"] == {
        "memory": "swarmavg.testing:MemoryTransport",
        "tcp": "swarmavg_tcp:TcpTransport",
        "quic": "swarmavg_quic:QuicTransport",
    }


def test_the_wheel_carries_the_transport_packages() -> None:
    wheel = _pyproject()["tool"]["hatch"]["build"]["targets"]["wheel"]  # type: ignore[index]
    packages = wheel["packages"]
    assert packages == [
        "swarmavg",
        "transports/tcp/swarmavg_tcp",
        "transports/quic/swarmavg_quic",
    ]
    for package in packages:
        assert (ROOT / package / "__init__.py").is_file(), package
        assert (ROOT / package / "py.typed").is_file(), package


def test_dependencies_need_no_other_distribution_of_ours() -> None:
    """Nothing that is not on a package index: ``pip install -e .`` from a clone must resolve."""
    project = _project()
    requirements = list(project["dependencies"])  # type: ignore[call-overload]
    for extra in project["optional-dependencies"].values():  # type: ignore[attr-defined]
        requirements += extra
    names = {
        r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()
        for r in requirements
    }
    assert not {n for n in names if n.startswith("swarmavg") and n != "swarmavg"}, names
    extras = project["optional-dependencies"]
    assert extras["quic"] == ["aioquic>=1.7.2,<1.8"]  # type: ignore[index]
    assert {"quic", "demo", "prometheus", "test", "dev", "docs"} <= set(extras)  # type: ignore[arg-type]


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.partition(".")[0])
    return found


def test_the_plugin_boundary() -> None:
    """swarmavg's code never imports a network transport (it finds them by entry point), and the
    transports import only swarmavg's public modules, not each other."""
    for path in (ROOT / "swarmavg").rglob("*.py"):
        assert not _imports(path) & {"swarmavg_tcp", "swarmavg_quic", "aioquic"}, path
    for name, other in (("tcp", "swarmavg_quic"), ("quic", "swarmavg_tcp")):
        for path in (ROOT / "transports" / name).rglob("*.py"):
            assert other not in _imports(path), path


def _imported_modules(path: Path, package: str) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every module that ``path`` (a module of ``package``) imports,
    anywhere in it (functions and ``if TYPE_CHECKING:`` blocks too): relative imports are
    resolved, ``from a import b`` gives ``a.b`` as well as ``a``, and ``importlib.import_module``
    or ``__import__`` with a literal name counts."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if name in ("import_module", "__import__") and isinstance(first, ast.Constant):
                yield node.lineno, str(first.value)


def test_the_optimizers_use_only_the_sync_facades() -> None:
    """``swarmavg.optim`` reaches the async layer only through the sync facades
    (:mod:`swarmavg.averager`, :mod:`swarmavg.dht`, :mod:`swarmavg.progress`) and takes the
    values it needs from modules outside ``aio/`` (:mod:`swarmavg._step`, ``proto/``)."""
    paths = sorted((ROOT / "swarmavg" / "optim").rglob("*.py"))
    assert len(paths) > 5
    found = []
    for path in paths:
        for line, module in _imported_modules(path, "swarmavg.optim"):
            if module == "swarmavg.aio" or module.startswith("swarmavg.aio."):
                found.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert not found, "\n".join(found)


def test_the_step_values_need_no_event_loop_or_torch() -> None:
    """:mod:`swarmavg._step` (``StepResult``, ``AveragingStage``) sits below ``aio/`` and the
    facades: it imports neither anyio, numpy, torch nor any of swarmavg's I/O layers."""
    path = ROOT / "swarmavg" / "_step.py"
    modules = {module for _, module in _imported_modules(path, "swarmavg")}
    heavy = {m for m in modules if m.partition(".")[0] in ("anyio", "numpy", "torch", "msgpack")}
    assert not heavy
    assert not {m for m in modules if m.startswith(("swarmavg.aio", "swarmavg.sync"))}


def test_the_oldest_session_installs_the_declared_lower_bounds() -> None:
    """``nox -s oldest`` tests the lower bounds that pyproject.toml declares: every bound of a
    dependency it pins is the version it installs (a bound raised, or lowered, without the
    session following would leave the declared range untested)."""
    source = (ROOT / "noxfile.py").read_text()
    start = source.index("OLDEST = {") + len("OLDEST = ")
    oldest = ast.literal_eval(source[start : source.index("}", start) + 1])
    assert isinstance(oldest, dict)
    bounds: dict[str, set[str]] = {}
    for requirement in _project()["dependencies"]:  # type: ignore[attr-defined]
        name, _, bound = requirement.partition(">=")
        if bound:
            bounds.setdefault(name.strip(), set()).add(bound.split(",")[0].strip())
    for name, version in oldest.items():
        assert name in bounds, name
        for bound in bounds[name]:
            assert version.split(".")[: len(bound.split("."))] == bound.split("."), (name, bound)
    assert {"anyio", "msgpack", "cryptography", "numpy"} <= set(oldest)
    start = source.index("OLDEST_LIGHTNING = {") + len("OLDEST_LIGHTNING = ")
    lightning = ast.literal_eval(source[start : source.index("}", start) + 1])
    extra = _project()["optional-dependencies"]["lightning"]  # type: ignore[index]
    assert extra == [f"lightning>={'.'.join(lightning['lightning'].split('.')[:2])},<3"], extra
    assert lightning["pytorch-lightning"] == lightning["lightning"]


def test_the_classifiers_name_exactly_the_pythons_ci_runs() -> None:
    """The Python versions the package declares (``requires-python``'s lower bound, the
    ``Programming Language :: Python :: 3.x`` classifiers) are the ones the noxfile's sessions
    run on (``PYTHONS``: the whole suite on the first, the in-process tiers on every one)."""
    source = (ROOT / "noxfile.py").read_text()
    start = source.index("PYTHONS = [") + len("PYTHONS = ")
    pythons = ast.literal_eval(source[start : source.index("]", start) + 1])
    assert pythons == sorted(pythons, key=lambda v: tuple(map(int, v.split("."))))
    project = _project()
    classifiers = project["classifiers"]
    assert isinstance(classifiers, list)
    prefix = "Programming Language :: Python :: "
    versions = [c.removeprefix(prefix) for c in classifiers if c.startswith(prefix)]
    declared = [v for v in versions if v.count(".") == 1]  # (not "3" alone)
    assert declared == pythons
    assert project["requires-python"] == f">={pythons[0]}"
