"""Finding transports by name: the ``swarmavg.transports`` entry-point group.

A transport plugin (ours or a third party's) declares, in its ``pyproject.toml``::

    [project.entry-points."swarmavg.transports"]
    tcp = "swarmavg_tcp:TcpTransport"

``resolve_transport("tcp")`` imports it only then, so ``import swarmavg`` never imports aioquic
or any other transport's dependencies. swarmavg's own network transports (the packages
``swarmavg_tcp`` and ``swarmavg_quic``) ship in its wheel and are registered the same way; the
QUIC one needs the ``quic`` extra (aioquic).
"""

from __future__ import annotations

import importlib
from functools import cache
from importlib.metadata import entry_points
from typing import Final

from swarmavg.abc import Transport
from swarmavg.errors import TransportNotFound

__all__ = ["available_transports", "resolve_transport"]

ENTRY_POINT_GROUP: Final = "swarmavg.transports"

#: Transports that ship with swarmavg; found even when the package metadata is missing
#: (e.g. running from a source checkout that was not installed).
_BUILTIN: Final = {"memory": "swarmavg.testing:MemoryTransport"}

#: What to install for the transports that ship with swarmavg (their packages are in every
#: install; a transport's own dependencies come with an extra).
SHIPPED: Final = {"tcp": "swarmavg", "quic": "swarmavg[quic]"}
#: The top-level modules a shipped transport needs beyond swarmavg's own dependencies.
_EXTRA_MODULES: Final = {"quic": frozenset({"aioquic"})}


def missing_extra(name: str, exc: BaseException | None) -> bool:
    """Whether ``exc`` (the ``__cause__`` of a :class:`TransportNotFound`) says that the
    shipped transport ``name`` lacks its optional dependency (its extra is not installed)."""
    return (
        isinstance(exc, ModuleNotFoundError)
        and exc.name is not None
        and exc.name.partition(".")[0] in _EXTRA_MODULES.get(name, ())
    )


def available_transports() -> list[str]:
    """Names of the transports that can be resolved in this environment."""
    names = set(_BUILTIN)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


@cache
def resolve_transport(name: str) -> type[Transport]:
    """The transport class registered as ``name`` (also a URL scheme such as ``"quic"``).

    :raises TypeError: if ``name`` is not a string.
    :raises TransportNotFound: if nothing is registered under ``name``, or what is registered
        cannot be imported (a broken install: the ``ImportError`` is the ``__cause__``) or is
        no transport; the message says which distribution to (re)install.
    """
    if not isinstance(name, str):
        raise TypeError(f"transport name must be a str, not {type(name).__name__}")
    target = None
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
        target = ep.value
        break
    if target is None:
        target = _BUILTIN.get(name)
    if target is None:
        hint = (
            f'swarmavg registers it: reinstall with `pip install "{SHIPPED[name]}"`'
            if name in SHIPPED
            else f"no installed package registers it under the entry-point group "
            f"{ENTRY_POINT_GROUP!r}"
        )
        known = ", ".join(available_transports())
        raise TransportNotFound(f"no transport named {name!r} ({hint}); available: {known}")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
        cls = getattr(module, attr) if attr else module
    except (ImportError, AttributeError) as exc:
        if missing_extra(name, exc):
            fix = f'install it with `pip install "{SHIPPED[name]}"`'
        elif name in SHIPPED:
            fix = f'reinstall it with `pip install --force-reinstall "{SHIPPED[name]}"`'
        else:
            fix = "reinstall the package that provides it"
        raise TransportNotFound(
            f"the {name!r} transport is registered ({ENTRY_POINT_GROUP} entry point "
            f"{name} = {target}) but cannot be loaded: {exc}; {fix}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TransportNotFound(f"entry point {name!r} = {target!r} is not a Transport subclass")
    return cls
