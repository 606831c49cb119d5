"""Developer and CI sessions: ``nox -s lint typecheck docs install tests oldest`` is what CI runs.

torch is pinned to the CPU build (2.13.0) before anything else is installed: an unpinned
``torch`` would pull a multi-GB CUDA build.
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "typecheck", "docs", "install", "tests", "oldest"]
nox.options.error_on_missing_interpreters = True

TORCH = "torch==2.13.0"
PYTHON = "3.11"
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
        # (the network lab's tests measure links, not dependencies: `tests` runs them)
        *(session.posargs or ["-q", "--durations=25", "--ignore=tests/netlab"]),
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
    """A short run of every fuzz harness (``nox -s fuzz -- --seconds 600`` for a long one)."""
    _install(session)
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
