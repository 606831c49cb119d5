"""Developer and CI sessions: ``nox -s lint typecheck docs install tests oldest pythons`` is what
CI runs.

torch is pinned to the CPU build (2.13.0) before anything else is installed: an unpinned
``torch`` would pull a multi-GB CUDA build. That build exists for Python 3.11 only (a local
find-links folder); on 3.12 and 3.13 the same pin takes PyPI's build of 2.13.0, a CUDA one
(~1.4 GB of downloads, once: uv keeps it in its cache), which runs on the CPU all the same.

Every declared Python (:data:`PYTHONS`) is looked up explicitly: pyenv's newest release of each
is linked into ``.nox/pythons/`` as ``pythonX.Y``, at the front of ``PATH``
(:func:`_link_pyenv_pythons`), because pyenv's shims answer only for the versions pyenv is told
to expose and nox would not find the others.

Virtual environments are made and filled by uv where it is installed (``pip install
"nox[uv]"``; it links packages from its cache instead of unpacking them again for every
session), by venv and pip otherwise. uv does not read pip's configuration, so the index,
find-links, constraint and certificate settings that pip has here are handed to uv
(:func:`_uv_settings_from_pip`): both install the same packages (on a machine whose CPU
build of torch comes from a local find-links folder, uv would otherwise fetch the CUDA one).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|venv"
nox.options.sessions = ["lint", "typecheck", "docs", "install", "tests", "oldest", "pythons"]
# CI must have every declared Python: a missing one fails the run. Elsewhere the sessions that
# need it are skipped, and nox says which interpreter it did not find.
nox.options.error_on_missing_interpreters = bool(os.environ.get("CI"))

TORCH = "torch==2.13.0"
#: The Python versions the package declares: ``requires-python`` in pyproject.toml starts at the
#: first and its classifiers name exactly these (tests/test_packaging.py checks both).
PYTHONS = ["3.11", "3.12", "3.13"]
#: the sessions' Python, the oldest declared; ``pythons`` runs the in-process tiers on the others
PYTHON = PYTHONS[0]
#: what ``oldest`` runs: the in-process tiers (tests/tiers.py) but the heavy swarms marked
#: ``slow`` (the same code at scale, which ``tests`` runs; ~40 s a session)
IN_PROCESS = "not process and not lab and not slow"
#: what ``pythons`` runs: that, and the child interpreters that must exit cleanly (process
#: tier), whose exit is where the Python version shows most
IN_PROCESS_AND_EXIT = f"({IN_PROCESS}) or interpreter_exit"
PACKAGES = [
    p
    for p in (
        "swarmavg",
        "transports",
        "tests",
        "fuzz",
        "benchmarks",
        "examples",
        "docs/hooks.py",
        "noxfile.py",
    )
    if Path(p).exists()
]


#: The lower bounds that pyproject.toml declares for swarmavg's dependencies, installed
#: exactly by ``nox -s oldest`` (tests/test_packaging.py checks that they match). torch stays
#: at TORCH: no CPU wheel of its bound (2.1) for this Python is at hand.
OLDEST = {
    "anyio": "4.11.0",
    "msgpack": "1.0.5",
    "cryptography": "47.0.0",
    "numpy": "1.26.4",
}
#: The lower bound of the ``lightning`` extra, installed by ``nox -s oldest`` too (both
#: namespaces: ``lightning.pytorch`` and ``pytorch_lightning``; tests/test_packaging.py checks
#: it against the extra). ``tests`` gets the newest release.
OLDEST_LIGHTNING = {"lightning": "2.4.0", "pytorch-lightning": "2.4.0"}


#: pip's settings (``pip config list``) and the uv environment variables that mean the same
_PIP_TO_UV = {
    "index-url": "UV_INDEX_URL",
    "extra-index-url": "UV_EXTRA_INDEX_URL",
    "find-links": "UV_FIND_LINKS",
    "constraint": "UV_CONSTRAINT",
    "cert": "SSL_CERT_FILE",
}


def _uv_settings_from_pip() -> dict[str, str]:
    """The uv environment that installs what pip, as configured on this machine, would."""
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    # e.g. "global.find-links='/opt/wheels'"; pip's precedence: its environment variables,
    # then the site, user and global files
    rank = {":env:": 0, "site": 1, "user": 2, "global": 3}
    chosen: dict[str, tuple[int, str]] = {}
    for line in listed.splitlines():
        found = re.fullmatch(r"([^.]*)\.([a-z-]+)=(.*)", line.strip())
        if found is None or found[2] not in _PIP_TO_UV:
            continue
        level = rank.get(found[1], 4)
        if found[2] not in chosen or level < chosen[found[2]][0]:
            chosen[found[2]] = (level, " ".join(shlex.split(found[3])))
    uv = {_PIP_TO_UV[name]: value for name, (_, value) in chosen.items()}
    if "UV_FIND_LINKS" in uv:  # (uv separates find-links locations by commas)
        uv["UV_FIND_LINKS"] = ",".join(uv["UV_FIND_LINKS"].split())
    # pip takes the best version across all indexes; uv's default stops at the first
    uv["UV_INDEX_STRATEGY"] = "unsafe-best-match"
    # pip compiles the installed modules to bytecode, uv does not: without it, where Python
    # writes no bytecode (PYTHONDONTWRITEBYTECODE) every interpreter the suite starts compiles
    # torch again (measured: the process tier took twice as long)
    uv["UV_COMPILE_BYTECODE"] = "1"
    return {name: value for name, value in uv.items() if name not in os.environ}


os.environ.update(_uv_settings_from_pip())


def _link_pyenv_pythons(versions: list[str]) -> None:
    """Link pyenv's newest release of each of ``versions`` into ``.nox/pythons/`` as
    ``pythonX.Y`` and put that folder first on ``PATH``, where nox (and uv, which nox hands the
    interpreter it found) look. pyenv's shims answer only for the versions pyenv is told to
    expose (``pyenv global``), so nox would not find the others. Only ``pythonX.Y`` names are
    added: ``python``, ``python3`` and ``pip`` stay what they were. A version pyenv lacks is
    left to nox's own search."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    links = Path(__file__).resolve().parent / ".nox" / "pythons"
    found = False
    for version in versions:
        releases = {}
        for path in root.glob(f"{version}.*/bin/python{version}"):
            patch = path.parents[1].name.removeprefix(f"{version}.")
            if patch.isdigit():  # (not 3.12-dev, 3.13.0t or a virtualenv)
                releases[int(patch)] = path
        if releases:
            links.mkdir(parents=True, exist_ok=True)
            link = links / f"python{version}"
            link.unlink(missing_ok=True)
            link.symlink_to(releases[max(releases)])
            found = True
    if found:
        os.environ["PATH"] = f"{links}{os.pathsep}{os.environ.get('PATH', '')}"


_link_pyenv_pythons(PYTHONS)


def _install(session: nox.Session, extras: str = "test") -> None:
    session.install(TORCH)
    # the transports ship inside swarmavg (tcp always, quic with its extra)
    session.install("-e", f".[{extras},quic]")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", *PACKAGES)
    session.run("ruff", "format", "--check", *PACKAGES)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the package (and the transport plugins as they land)."""
    _install(session, "dev")
    session.run("mypy")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite. With arguments (``nox -s tests -- -k memory``) they go to pytest, and a
    selection that matches no test is not an error; without, pytest must run tests."""
    _install(session)
    codes = [0, 5] if session.posargs else [0]
    session.run(
        "pytest",
        *(session.posargs or ["--durations=25"]),  # (where the suite's time goes)
        env={"HYPOTHESIS_PROFILE": "ci"},
        success_codes=codes,
    )


@nox.session(python=PYTHON)
def oldest(session: nox.Session) -> None:
    """The suite with the oldest dependencies pyproject.toml allows (OLDEST), so that its
    lower bounds stay true: the latest versions, which ``tests`` gets, hide an API that an
    older release lacks."""
    session.install(TORCH)
    constraints = Path(session.create_tmp()) / "oldest.txt"
    pins = {**OLDEST, **OLDEST_LIGHTNING}
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in pins.items()))
    session.install("-c", str(constraints), "-e", ".[test,quic]")
    session.run(
        "python",
        "-c",
        "import importlib.metadata as m, sys; "
        "sys.exit(any(m.version(n) != v for n, v in " + repr(pins) + ".items()))",
    )
    session.run(
        "pytest",
        # the in-process tiers (tests/tiers.py): what depends on the versions of anyio,
        # msgpack, cryptography, numpy and Lightning runs there; `tests` runs every tier
        *(session.posargs or ["-q", "--durations=25", "-m", IN_PROCESS]),
        env={"HYPOTHESIS_PROFILE": "ci"},
        success_codes=[0, 5] if session.posargs else [0],
    )


@nox.session(python=PYTHONS[1:])
def pythons(session: nox.Session) -> None:
    """The in-process tiers and the clean-exit checks (:data:`IN_PROCESS_AND_EXIT`) on every
    declared Python but :data:`PYTHON`, where ``tests`` runs the whole suite, with the newest
    dependencies (``nox -s pythons-3.13`` for one). torch is PyPI's build of the pinned release
    there, a CUDA one: the only wheel of it for those versions."""
    _install(session)
    session.run(
        "pytest",
        *(session.posargs or ["-q", "--durations=10", "-m", IN_PROCESS_AND_EXIT]),
        env={"HYPOTHESIS_PROFILE": "ci"},
        success_codes=[0, 5] if session.posargs else [0],
    )


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The documentation site, built with ``--strict``: a broken link, a page missing from the
    nav or a docstring mkdocstrings cannot read fails (``-- serve`` previews it instead)."""
    session.install(TORCH)
    session.install("-e", ".[docs]")
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", *session.posargs[1:])
    else:
        site = Path(session.create_tmp()) / "site"
        session.run("mkdocs", "build", "--strict", "--site-dir", str(site), *session.posargs)
        session.log(f"the site is in {site}")


@nox.session(python=PYTHON)
@nox.parametrize("editable", [False, True], ids=["wheel", "editable"])
def install(session: nox.Session, editable: bool) -> None:
    """What a newcomer does: ``pip install .`` (or ``-e .``) of a fresh clone, nothing else, in
    a fresh venv, then a TCP swarm: two DHT peers average a tensor, and the CLI answers. The
    clone is of the committed tree (HEAD), as CI's is."""
    clone = Path(session.create_tmp()) / "clone"
    if clone.exists():
        session.run("rm", "-rf", str(clone), external=True)
    session.run(
        "git", "clone", "--quiet", "--no-hardlinks", ".", str(clone), external=True, silent=True
    )
    session.install(TORCH)
    session.install(*(["-e"] if editable else []), str(clone))
    check = Path("tests/install_check.py").resolve()
    with session.chdir(session.create_tmp()):  # not the tree: import what pip installed
        session.run("python", str(check), str(clone))
        session.run("swarmavg", "--help", silent=True)


@nox.session(python=PYTHON)
def fuzz(session: nox.Session) -> None:
    """The property tests on the ``dev`` hypothesis profile (``HYPOTHESIS_PROFILE=thorough``
    for more) and a short run of every fuzz harness (``nox -s fuzz -- --seconds 600`` for a
    long one)."""
    _install(session)
    # the suite's property tests with more examples than CI's profile gives them
    profile = os.environ.get("HYPOTHESIS_PROFILE", "dev")
    session.run("pytest", "-q", "-m", "hypothesis", env={"HYPOTHESIS_PROFILE": profile})
    args = session.posargs or ["--seconds", "20"]
    session.run("python", "fuzz/fuzz_wire.py", *args)
    session.run("python", "fuzz/fuzz_tcp.py", *args)
    session.run("python", "fuzz/fuzz_quic.py", *args)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The benchmarks, each beside its reference measured in the same run."""
    _install(session)
    session.install("psutil")
    session.run("python", "benchmarks/transport.py", *session.posargs)
    # hivemind's side runs in its own venv (see benchmarks/dht.py); without it, ours alone
    session.run("python", "benchmarks/dht.py", *session.posargs)
    # beside gloo (torch, installed above) and hivemind's venv, as dht.py
    session.run("python", "benchmarks/averaging.py", *session.posargs)
    # 1024 peers' Moshpit rounds through the sans-IO averaging code (no network, no clock)
    session.run("python", "benchmarks/averaging_sim.py")
    # 1024 real averagers in one process (MemoryTransport) from random group bits (minutes)
    session.run("python", "benchmarks/averaging_scale.py")


@nox.session(python=PYTHON)
def netlab(session: nox.Session) -> None:
    """The network lab's long runs (Linux, root; minutes each): the fault matrix of 100
    randomized runs, training under churn (a change every 20 s, 8 changes) and a 30 s
    partition, training to a target loss beside hivemind.Optimizer, and the all-reduce figures
    beside the bound, gloo and hivemind (``benchmarks/network.py``; hivemind's side needs its
    venv, see ``benchmarks/dht.py``)."""
    _install(session)
    session.run("python", "benchmarks/network_faults.py", "--runs", "100")
    session.run("python", "benchmarks/network_training.py", "churn", "--period", "20")
    session.run("python", "benchmarks/network_training.py", "partition", "--split", "30")
    session.run("python", "benchmarks/network_training.py", "speed")
    session.run("python", "benchmarks/network.py", *session.posargs)
