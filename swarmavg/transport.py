"""Finding transports by name: the ``swarmavg.transports`` entry-point group.

A transport plugin (ours or a third party's) declares, in its ``pyproject.toml``::

    [project.entry-points."swarmavg.transports"]
    tcp = "swarmavg_tcp:TCPTransport"

``resolve_transport("tcp")`` imports it only then, so ``import swarmavg`` never imports aioquic
or any other transport's dependencies.
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

#: What to install for the transports the project publishes.
_DISTRIBUTIONS: Final = {"tcp": "swarmavg-tcp", "quic": "swarmavg-quic"}


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
            f"install it with `pip install {_DISTRIBUTIONS[name]}`"
            if name in _DISTRIBUTIONS
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
        fix = (
            f"reinstall it with `pip install --force-reinstall {_DISTRIBUTIONS[name]}`"
            if name in _DISTRIBUTIONS
            else "reinstall the package that provides it"
        )
        raise TransportNotFound(
            f"the {name!r} transport is registered ({ENTRY_POINT_GROUP} entry point "
            f"{name} = {target}) but cannot be loaded: {exc}; {fix}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TransportNotFound(f"entry point {name!r} = {target!r} is not a Transport subclass")
    return cls
