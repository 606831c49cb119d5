"""A fork server for the tests' peer processes: one interpreter per test session that has
imported numpy, torch and swarmavg, and forks a child for each peer a test starts, instead of
a fresh ``python`` that imports them again (1.5-3.5 s of CPU each on a 2-core machine); peers
that need more (Lightning's) get a second one that has imported that too.

:func:`popen` takes the arguments of :class:`subprocess.Popen` that the tests use and returns
a :class:`ForkedProcess`, which has the attributes and methods of a ``Popen`` that the tests
use (``pid``, ``poll()``, ``wait(timeout)``, ``returncode``, ``send_signal()``, ``kill()``,
pipes, ``communicate()``). It starts a real interpreter instead (and returns the ``Popen``)
where a fork would not behave as ``python script.py`` would:

- ``SWARMAVG_TEST_REAL_STARTS=1`` in the environment: every start is real;
- an argv other than ``[sys.executable, SCRIPT, ...]`` or ``[sys.executable, "-m", MODULE,
  ...]`` (interpreter options, another Python), a missing script;
- not Linux (no ``os.pidfd_open``), or coverage measuring subprocesses;
- an environment that differs from the server's in a variable read when an interpreter starts
  or a preloaded module is imported (:data:`STARTUP_ENV`: ``PYTHON*`` but ``PYTHONPATH``,
  ``PYTHONUNBUFFERED`` and ``PYTHONDONTWRITEBYTECODE``, the locale, ``LD_*``, OpenMP, MKL and
  OpenBLAS settings but ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS``, ``TORCH*``, ``CUDA*``,
  ``NPY_*``, coverage's);
- a ``sys.path`` (the script's folder, ``PYTHONPATH``) under which a module the server holds
  would be imported from another file.

The child is made what a fresh interpreter would be: ``sys.argv``, ``sys.orig_argv``,
``sys.path``, a new ``__main__`` module (``runpy`` as ``-m`` does, for a module), the
environment, the working folder, new ``sys.stdin``/``stdout``/``stderr`` on the given files
(``PYTHONUNBUFFERED`` honoured), no other file descriptor, SIGINT raising KeyboardInterrupt,
its own session where ``start_new_session`` asks, fresh seeds for ``random``, numpy's global
generator and torch's default generator, torch's and OpenBLAS's thread counts from
``OMP_NUM_THREADS``/``MKL_NUM_THREADS``. It then runs at the top level of the server's
script, so its exit is an interpreter's own: ``SystemExit`` codes, a traceback and code 1,
an unhandled KeyboardInterrupt ending it by SIGINT, atexit handlers, non-daemon threads
joined. What stays different: its parent is the server (``os.getppid()``, ``psutil``'s
``children()`` of the test process); every child shares the server's string-hash seed; the
preloaded modules' objects sit in the collector's permanent generation (``gc.freeze()``: a
child's collections and its exit skip them, 0.2 s of CPU less per child, and
``gc.get_objects()`` leaves them out); a traceback that reaches the top level shows two frames
of this script above the child's own.

The server is single-threaded when it forks (it checks, and refuses otherwise): it runs
OpenBLAS with one thread (the child sets its own count) and makes torch create no thread pool.
Protocol: a ``SOCK_SEQPACKET`` socket pair; a request is one JSON message whose file
descriptors (``socket.send_fds``) are a new socket for that child's answers and its stdin,
stdout and stderr. Answers on the child's socket: ``{"pid"}`` with a pidfd (signals go
through it: no pid reuse race), then ``{"returncode"}`` (``-N`` for signal N, as ``Popen``);
or ``{"refused": why}`` (a real start follows), or ``{"error"}``. When the test process
closes the server's socket (at the end of the session, or by dying), the server SIGKILLs the
children still running (their process groups for those in sessions of their own) and exits.
Should the server die, a handle whose child it had not reported raises
:class:`ForkServerError` from ``poll()``/``wait()``; ``kill()`` still reaches the child.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import locale
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

#: set to 1 (any non-empty value) to start every peer as a real interpreter
REAL_STARTS_ENV = "SWARMAVG_TEST_REAL_STARTS"
#: what the server imports before its first fork (those that fail to import are left out)
PRELOAD = (
    "numpy",
    "torch",
    "swarmavg",
    "swarmavg.accumulator",
    "swarmavg.optim",
    "swarmavg.sync",
    "swarmavg_tcp",
    "swarmavg_quic",
)
#: variables read when an interpreter starts or a preloaded module is imported: a start whose
#: environment differs from the server's in one of them is a real one
STARTUP_ENV = re.compile(
    r"^(PYTHON(?!PATH$|UNBUFFERED$|DONTWRITEBYTECODE$).*|LANG|LANGUAGE|LC_.*|LD_.*|MALLOC_.*"
    r"|OMP_(?!NUM_THREADS$).*|GOMP_.*|KMP_.*|MKL_(?!NUM_THREADS$).*|OPENBLAS_.*|GOTO_.*"
    r"|TORCH.*|PYTORCH.*|CUDA.*|NPY_.*|NUMPY_.*|COVERAGE_.*|COV_CORE_.*|_FORKSERVER_.*)$"
)
#: called with a description of each start through the server (tests/tiers.py counts them)
START_HOOKS: list[Callable[[str], None]] = []
#: starts this session: "forked", and real ones by their reason
STARTS: Counter[str] = Counter()

_MESSAGE_MAX = 1 << 20
_READY_TIMEOUT = 120.0  # the server's imports, on a loaded 2-core machine
_ANSWER_TIMEOUT = 60.0  # a fork (its checks take milliseconds)
_RESTORE_ENV = "_FORKSERVER_RESTORE"  # (the server's own variables, put back after its imports)


class ForkServerError(RuntimeError):
    """The fork server failed or died (its log's tail is in the message)."""


# -- the test side ----------------------------------------------------------------------------


class ForkedProcess:
    """A child of the fork server, used as a :class:`subprocess.Popen` is."""

    def __init__(
        self,
        args: list[str],
        pid: int,
        pidfd: int,
        channel: socket.socket,
        pipes: tuple[IO[Any] | None, IO[Any] | None, IO[Any] | None],
    ) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self.stdin, self.stdout, self.stderr = pipes
        self._channel = channel
        self._lock = threading.Lock()
        self._lost = False
        self._output: dict[int, Any] = {}
        self._readers: list[threading.Thread] = []
        # (the pidfd lives as long as the handle: signals never reach a reused pid)
        self._pidfd_closer = weakref.finalize(self, os.close, pidfd)
        self._channel_closer = weakref.finalize(self, channel.close)
        self._pidfd = pidfd

    def __repr__(self) -> str:
        return f"<ForkedProcess pid={self.pid} returncode={self.returncode}>"

    def _collect(self, timeout: float | None) -> bool:
        """Read the exit status if it comes within ``timeout`` seconds (``None``: no limit);
        whether it is known. Raises :class:`ForkServerError` if the server died first."""
        if self.returncode is not None:
            return True
        began = time.monotonic()
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return self.returncode is not None
        try:
            if self.returncode is not None:
                return True
            if self._lost:
                raise ForkServerError(f"the fork server died: pid {self.pid}'s status is unknown")
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - began))
            ready, _, _ = select.select([self._channel], [], [], left)
            if not ready:
                return False
            message = self._channel.recv(_MESSAGE_MAX)
            self._channel_closer()
            if not message:
                self._lost = True
                raise ForkServerError(f"the fork server died: pid {self.pid}'s status is unknown")
            self.returncode = int(json.loads(message)["returncode"])
            return True
        finally:
            self._lock.release()

    def poll(self) -> int | None:
        self._collect(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._collect(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """As ``Popen.communicate``: ``input`` written to stdin (then closed), stdout and
        stderr read to their ends, the exit waited for; :class:`subprocess.TimeoutExpired`
        after ``timeout`` seconds (call it again to go on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._readers:
            if self.stdin is not None:
                with contextlib.suppress(BrokenPipeError):
                    if input:
                        self.stdin.write(input)
                    self.stdin.close()
            for stream in (self.stdout, self.stderr):
                if stream is not None:
                    reader = threading.Thread(target=self._read_all, args=(stream,), daemon=True)
                    reader.start()
                    self._readers.append(reader)
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return (self._output.get(id(self.stdout)), self._output.get(id(self.stderr)))

    def _read_all(self, stream: IO[Any]) -> None:
        self._output[id(stream)] = stream.read()
        stream.close()

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self.wait()


#: what :func:`popen` returns
Process = ForkedProcess | subprocess.Popen[Any]


def _wrap(fd: int, write: bool, text: bool, encoding: str | None, errors: str | None) -> IO[Any]:
    """The test's end of a pipe, as ``Popen`` makes it."""
    binary = open(fd, "wb" if write else "rb")  # noqa: SIM115 (the handle's to close)
    if not text:
        return binary
    encoding = encoding or locale.getpreferredencoding(False)
    return io.TextIOWrapper(binary, encoding, errors, write_through=write)


class ForkServer:
    """One server process (started here) that has imported :data:`PRELOAD` and ``preload``,
    and the requests to it; :meth:`close` ends it and every child it still has."""

    def __init__(self, preload: Sequence[str] = ()) -> None:
        log, self.log_path = tempfile.mkstemp(prefix="swarmavg-forkserver-", suffix=".log")
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        restore = {name: os.environ.get(name) for name in ("OPENBLAS_NUM_THREADS",)}
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", _RESTORE_ENV: json.dumps(restore)}
        self._lock = threading.Lock()
        with theirs:
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), str(theirs.fileno()), *preload],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    pass_fds=[theirs.fileno()],
                    env=env,
                )
            finally:
                os.close(log)
        try:
            ready, _, _ = select.select([self._control], [], [], _READY_TIMEOUT)
            hello = self._control.recv(_MESSAGE_MAX) if ready else b""
            if not hello:
                raise ForkServerError(f"the fork server did not start\n{self.log_tail()}")
            self.hello: dict[str, Any] = json.loads(hello)
        except BaseException:
            self.close()
            raise

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as log:
            return log.read()[-chars:]
        return ""

    def alive(self) -> bool:
        return self.proc.poll() is None and self._control.fileno() != -1

    def spawn(
        self, request: dict[str, Any], stdio: tuple[int, int, int]
    ) -> tuple[int, int, socket.socket] | str:
        """Fork a child for ``request``: its pid, pidfd and the socket its exit status comes
        on, or why the server refused (then start it for real)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with self._lock, theirs:
                try:
                    socket.send_fds(
                        self._control, [json.dumps(request).encode()], [theirs.fileno(), *stdio]
                    )
                except OSError as exc:
                    raise ForkServerError(
                        f"the fork server is gone ({exc})\n{self.log_tail()}"
                    ) from exc
            ready, _, _ = select.select([mine], [], [], _ANSWER_TIMEOUT)
            if not ready:
                raise ForkServerError(f"the fork server did not answer\n{self.log_tail()}")
            message, fds, _, _ = socket.recv_fds(mine, _MESSAGE_MAX, 1)
            if not message:
                raise ForkServerError(f"the fork server died\n{self.log_tail()}")
            answer = json.loads(message)
        except BaseException:
            mine.close()
            raise
        if "pid" in answer:
            os.set_inheritable(fds[0], False)
            return answer["pid"], fds[0], mine
        mine.close()
        if "refused" in answer:
            return str(answer["refused"])
        raise ForkServerError(f"the fork server failed: {answer.get('error')}\n{self.log_tail()}")

    def close(self, timeout: float = 10.0) -> None:
        """End the server: it kills the children it still has, then exits."""
        self._control.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)

    def popen(
        self,
        args: Sequence[str | os.PathLike[str]],
        *,
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        text: bool = False,
        encoding: str | None = None,
        errors: str | None = None,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        start_new_session: bool = False,
    ) -> ForkedProcess | str:
        """A forked child for ``args``, or why not (then start it for real)."""
        argv = [os.fspath(arg) for arg in args]
        if len(argv) < 2 or argv[0] != sys.executable:
            return "not this interpreter"
        if argv[1] == "-m" and len(argv) > 2:
            target = {"module": argv[2], "args": argv[3:]}
        elif not argv[1].startswith("-"):
            target = {"script": argv[1], "args": argv[2:]}
        else:
            return "interpreter options"
        request = {
            **target,
            "argv": argv,
            "cwd": os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd()),
            "env": dict(os.environ if env is None else env),
            "new_session": start_new_session,
        }
        text = text or encoding is not None or errors is not None
        ours: list[IO[Any] | None] = []
        theirs: list[int] = []
        to_close: list[int] = []
        try:
            for index, spec in enumerate((stdin, stdout, stderr)):
                if spec is None:
                    theirs.append(index)
                    ours.append(None)
                elif spec == subprocess.PIPE:
                    read, write = os.pipe()
                    theirs.append(read if index == 0 else write)
                    to_close.append(theirs[-1])
                    ours.append(
                        _wrap(write if index == 0 else read, index == 0, text, encoding, errors)
                    )
                elif spec == subprocess.DEVNULL:
                    theirs.append(os.open(os.devnull, os.O_RDWR))
                    to_close.append(theirs[-1])
                    ours.append(None)
                elif spec == subprocess.STDOUT and index == 2:
                    theirs.append(theirs[1])
                    ours.append(None)
                else:
                    theirs.append(spec if isinstance(spec, int) else spec.fileno())
                    ours.append(None)
            answer = self.spawn(request, (theirs[0], theirs[1], theirs[2]))
        except BaseException:
            for stream in ours:
                if stream is not None:
                    stream.close()
            raise
        finally:
            for fd in to_close:
                os.close(fd)
        if isinstance(answer, str):
            for stream in ours:
                if stream is not None:
                    stream.close()
            return answer
        pid, pidfd, channel = answer
        return ForkedProcess(argv, pid, pidfd, channel, (ours[0], ours[1], ours[2]))


_servers: dict[tuple[str, ...], ForkServer] = {}  # (by their extra preloads)
_servers_lock = threading.Lock()


def _unavailable() -> str | None:
    """Why this process starts no child through a fork server, if it does not."""
    if os.environ.get(REAL_STARTS_ENV):
        return REAL_STARTS_ENV
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return "not Linux"
    if any(os.environ.get(name) for name in ("COVERAGE_PROCESS_START", "COV_CORE_SOURCE")):
        return "coverage"
    return None


def server(preload: Sequence[str] = ()) -> ForkServer:
    """This process's fork server that has imported ``preload`` too (started at the first
    call, or again if it died)."""
    key = tuple(sorted(preload))
    with _servers_lock:
        found = _servers.get(key)
        if found is None or not found.alive():
            if found is not None:
                found.close()
            found = _servers[key] = ForkServer(key)
        return found


def shutdown() -> None:
    """End this process's fork server and every child it still has (tests/conftest.py calls
    it at the end of the session)."""
    with _servers_lock:
        while _servers:
            _servers.popitem()[1].close()


def popen(
    args: Sequence[str | os.PathLike[str]],
    *,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    encoding: str | None = None,
    errors: str | None = None,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    start_new_session: bool = False,
    preload: Sequence[str] = (),
) -> Process:
    """``subprocess.Popen(args, ...)`` for a peer: a child of this session's fork server, or a
    real interpreter where a fork would not do (the module's docstring says when). ``preload``:
    more modules for the server to import (``lightning.pytorch``): such peers get a server of
    their own, so that the others' stays as it was."""
    why = _unavailable()
    if why is None:
        forked = server(preload).popen(
            args,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            text=text,
            encoding=encoding,
            errors=errors,
            cwd=cwd,
            env=env,
            start_new_session=start_new_session,
        )
        if isinstance(forked, ForkedProcess):
            STARTS["forked"] += 1
            what = " ".join(forked.args[1:3]) if forked.args[1] == "-m" else forked.args[1]
            for hook in list(START_HOOKS):
                hook(f"fork server: {os.path.basename(what)}")
            return forked
        why = forked
    STARTS[f"real ({why})"] += 1
    return subprocess.Popen(
        args,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        text=text,
        encoding=encoding,
        errors=errors,
        cwd=cwd,
        env=env,
        start_new_session=start_new_session,
    )


def run(
    args: Sequence[str | os.PathLike[str]],
    *,
    timeout: float | None = None,
    check: bool = False,
    capture_output: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` through :func:`popen` (the child is killed on a timeout)."""
    if capture_output:
        kwargs |= {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    with popen(args, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            proc.kill()
            raise
    done = subprocess.CompletedProcess(list(map(os.fspath, args)), proc.wait(), out, err)
    if check:
        done.check_returncode()
    return done


# -- the server ---------------------------------------------------------------------------------


@dataclass
class _Child:
    """A child the server forked and has not reaped yet."""

    pid: int
    pidfd: int
    channel: socket.socket
    new_session: bool


@dataclass
class _Request:
    """What a forked child becomes (built in the server, used in the child)."""

    fields: dict[str, Any]
    stdio: list[int]
    #: closed once the child has its session and its files (the server waits for that, as
    #: Popen waits for the exec)
    started: int
    #: the server's descriptors and sockets the child closes
    sockets: list[socket.socket] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)


@dataclass
class _State:
    """The server's view of a fresh interpreter, taken after its imports."""

    env: dict[str, str]
    #: sys.path without its first entry and PYTHONPATH's
    base_path: list[str]
    stdio: list[tuple[str, str]]
    openblas: Any = None  # (the OpenBLAS ``set_num_threads`` function, found with ctypes)
    children: dict[int, _Child] = field(default_factory=dict)  # by pidfd


def _openblas_setter() -> Any:
    """OpenBLAS's ``openblas_set_num_threads`` where a loaded library has it (numpy's wheels
    rename it, as threadpoolctl knows), else None."""
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1]}
    for path in sorted(paths):
        with contextlib.suppress(OSError):
            library = ctypes.CDLL(path)
            for prefix in ("", "scipy_"):
                for suffix in ("", "64_", "_64_"):
                    function = getattr(library, f"{prefix}openblas_set_num_threads{suffix}", None)
                    if function is not None:
                        return function
    return None


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _start_server() -> _State:
    """The server's imports, then its view of a fresh interpreter."""
    import importlib

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl+C ends the session, which ends us)
    if not sys.flags.safe_path:
        del sys.path[0]  # (this script's folder: a child gets its own)
    env = dict(os.environ)
    for name, value in json.loads(env.pop(_RESTORE_ENV, "{}")).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    pythonpath = {os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p}
    base = [entry for entry in sys.path if entry not in pythonpath]
    for name in (*PRELOAD, *sys.argv[2:]):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    os.environ.clear()
    os.environ.update(env)
    gc.collect()
    gc.freeze()
    stdio = [(s.encoding, s.errors or "strict") for s in (sys.stdin, sys.stdout, sys.stderr)]
    return _State(env, base, stdio, openblas=_openblas_setter())


def _child_path(state: _State, request: dict[str, Any]) -> list[str]:
    """``sys.path`` as a fresh interpreter would make it for ``request``."""
    cwd, env = request["cwd"], request["env"]
    first: list[str] = []
    if not env.get("PYTHONSAFEPATH"):
        if "module" in request:
            first = [cwd]
        else:
            first = [os.path.dirname(os.path.realpath(os.path.join(cwd, request["script"])))]
    pythonpath = env.get("PYTHONPATH", "").split(os.pathsep)
    entries = [*first, *(os.path.join(cwd, p) for p in pythonpath if p), *state.base_path]
    path: list[str] = []
    for entry in entries:
        entry = os.path.abspath(entry) if entry else entry
        if entry not in path:
            path.append(entry)
    return path


def _find(name: str, path: list[str]) -> Any:
    """The spec the import system would find for top-level module ``name`` under ``path``."""
    import importlib.machinery

    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        is_path_finder = finder is importlib.machinery.PathFinder
        with contextlib.suppress(Exception):
            spec = find(name, path if is_path_finder else None)
            if spec is not None:
                return spec
    return None


def _refusal(state: _State, request: dict[str, Any]) -> str | None:
    """Why a fork would not behave as a fresh interpreter for ``request``, if it would not."""
    import importlib

    env: dict[str, str] = request["env"]
    for name in sorted(set(env) | set(state.env)):
        if env.get(name) != state.env.get(name) and STARTUP_ENV.match(name):
            return f"{name} differs"
    threads = [env.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")]
    if threads != [state.env.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")]:
        given = [value for value in threads if value is not None]
        if not given or not all(value.isdigit() and int(value) > 0 for value in given):
            return "OMP_NUM_THREADS/MKL_NUM_THREADS unset or not a count"
    if "script" in request and not os.path.isfile(os.path.join(request["cwd"], request["script"])):
        return "no such script"
    if not os.path.isdir(request["cwd"]):
        return "no such folder"
    path = _child_path(state, request)
    importlib.invalidate_caches()  # (folders made since the last request)
    for name, module in list(sys.modules.items()):
        # (files only: built-in, frozen and made-up modules do not depend on the path, and a
        # namespace package's path follows sys.path by itself)
        spec = getattr(module, "__spec__", None)
        if "." in name or spec is None or not spec.has_location:
            continue
        origin = getattr(_find(name, path), "origin", None)
        if origin != spec.origin:
            return f"module {name} would come from {origin}, not {spec.origin}"
    if threading.active_count() != 1 or _threads() != 1:
        return f"the server has {_threads()} threads"
    return None


def _send(channel: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    with contextlib.suppress(OSError):  # (the test may have dropped the handle)
        socket.send_fds(channel, [json.dumps(message).encode()], list(fds))


def _serve(control: socket.socket, state: _State) -> _Request | None:
    """Serve requests until the test process closes ``control``; in a forked child, return
    what it is to become. Returns None in the server once it has ended its children."""
    poller = select.poll()
    poller.register(control, select.POLLIN)
    _send(control, {"ready": os.getpid(), "openblas": state.openblas is not None})
    while True:
        for fd, _ in poller.poll():
            if fd != control.fileno():
                child = state.children.pop(fd)
                poller.unregister(fd)
                _, status = os.waitpid(child.pid, 0)
                _send(child.channel, {"returncode": os.waitstatus_to_exitcode(status)})
                child.channel.close()
                os.close(child.pidfd)
                continue
            message, fds, _, _ = socket.recv_fds(control, _MESSAGE_MAX, 4)
            if not message:
                _end_children(state)
                return None
            channel = socket.socket(fileno=fds[0])
            try:
                forked = _fork(control, state, json.loads(message), channel, fds[1:])
            except Exception as exc:  # (a bad request: the server goes on)
                traceback.print_exc()
                _send(channel, {"error": f"{type(exc).__name__}: {exc}"})
                forked = None
            if isinstance(forked, _Request):
                return forked  # (in the child)
            for stdio in fds[1:]:
                os.close(stdio)
            if forked is None:
                channel.close()
            else:
                poller.register(forked, select.POLLIN)


def _fork(
    control: socket.socket,
    state: _State,
    request: dict[str, Any],
    channel: socket.socket,
    stdio: list[int],
) -> _Request | int | None:
    """Fork a child for ``request`` and tell the test its pid: the child's pidfd in the
    server, what it is to become in the child; None if refused (the test was told why)."""
    why = _refusal(state, request)
    if why is not None:
        _send(channel, {"refused": why})
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # (a child's collector, and its exit, then leave the server's objects alone)
    started, started_in_child = os.pipe()
    pid = os.fork()
    if pid == 0:
        return _Request(
            request,
            stdio,
            started_in_child,
            sockets=[control, channel, *(c.channel for c in state.children.values())],
            fds=[started, *state.children],
        )
    os.close(started_in_child)
    os.read(started, 1)  # (the end of the file: the child has closed its end)
    os.close(started)
    pidfd = os.pidfd_open(pid)
    state.children[pidfd] = _Child(pid, pidfd, channel, request["new_session"])
    _send(channel, {"pid": pid}, [pidfd])
    return pidfd


def _end_children(state: _State) -> None:
    """SIGKILL to every child still running (to its process group if it has its own), then
    reap them and report their ends."""
    for child in state.children.values():
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
        if child.new_session:  # (a group only once the child has made it)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
    for child in state.children.values():
        _, status = os.waitpid(child.pid, 0)
        _send(child.channel, {"returncode": os.waitstatus_to_exitcode(status)})
        child.channel.close()
        os.close(child.pidfd)
    state.children.clear()


def _stdio(fd: int, encoding: str, errors: str, buffered: bool) -> io.TextIOWrapper:
    """``sys.stdin`` (fd 0), ``stdout`` (1) or ``stderr`` (2) as an interpreter makes it at
    startup (Python/pylifecycle.c: create_stdio)."""
    write = fd != 0
    buffering = -1 if buffered or not write else 0
    buf = open(fd, "wb" if write else "rb", buffering=buffering, closefd=False)  # noqa: SIM115
    raw = buf if isinstance(buf, io.FileIO) else buf.raw  # type: ignore[attr-defined]
    raw.name = ("<stdin>", "<stdout>", "<stderr>")[fd]
    line_buffering = buffered and (raw.isatty() or fd == 2)
    stream = io.TextIOWrapper(buf, encoding, errors, "\n", line_buffering, not buffered)
    stream.mode = "w" if write else "r"  # type: ignore[misc]
    return stream


def _become(state: _State, child: _Request) -> None:
    """Make this forked child what ``python SCRIPT ...`` or ``python -m MODULE ...`` would be
    (its code runs from here: its exceptions leave this script's top level)."""
    import builtins
    import importlib
    import importlib.machinery
    import runpy
    import types

    request = child.fields
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(child.stdio):
        os.dup2(fd, target)
    for sock in child.sockets:
        sock.close()
    for fd in {*child.stdio, *child.fds, child.started}:
        os.close(fd)
    for name in os.listdir("/proc/self/fd"):  # (anything else: a fresh interpreter has none)
        with contextlib.suppress(OSError):
            if int(name) > 2:
                os.close(int(name))
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    buffered = not env.get("PYTHONUNBUFFERED")
    streams = [_stdio(fd, *state.stdio[fd], buffered) for fd in range(3)]
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams  # type: ignore[misc]
    # threads: torch's and OpenBLAS's counts come from the environment at import (ours)
    threads = env.get("MKL_NUM_THREADS") or env.get("OMP_NUM_THREADS")
    if "torch" in sys.modules and threads != (
        state.env.get("MKL_NUM_THREADS") or state.env.get("OMP_NUM_THREADS")
    ):
        sys.modules["torch"].set_num_threads(int(threads or 0))
    blas = next(
        (
            env[n]
            for n in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
            if env.get(n)
        ),
        None,
    )
    count = int(blas) if blas and blas.isdigit() else len(os.sched_getaffinity(0))
    if state.openblas is not None and count != 1:
        state.openblas(count)
    # fresh seeds (`random` reseeds itself after a fork)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    sys.path[:] = _child_path(state, request)
    importlib.invalidate_caches()
    sys.orig_argv[:] = request["argv"]
    main = types.ModuleType("__main__")
    main.__dict__.update(__annotations__={}, __builtins__=builtins, __loader__=None)
    sys.modules["__main__"] = main
    if "module" in request:
        sys.argv[:] = ["-m", *request["args"]]
        runpy._run_module_as_main(request["module"])  # type: ignore[attr-defined]  # (what -m runs)
        return
    sys.argv[:] = [request["script"], *request["args"]]
    path = os.path.abspath(request["script"])
    main.__file__ = path
    main.__cached__ = None  # type: ignore[attr-defined]
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    with io.open_code(path) as source:
        code = compile(source.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)  # (what `python SCRIPT` does)


def _main() -> None:
    state = _start_server()
    control = socket.socket(fileno=int(sys.argv[1]))
    child = _serve(control, state)
    if child is None:
        return
    del control
    _become(state, child)


if __name__ == "__main__":
    _main()
