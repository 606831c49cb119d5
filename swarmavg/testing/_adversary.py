"""A dishonest peer for tests: the library's own peer, with the messages it sends rewritten.

Adversarial tests run real peers (so that everything the attacker does not change behaves
exactly as the library does) and rewrite what one of them sends, at the RPC layer, before
it is encoded::

    attacker = Adversary(dhts[2])  # a DHT (its node) or a Node
    attacker.requests(AvgBegin, lambda m: dataclasses.replace(m, weight=1e39))
    attacker.answers(AvgPart, lambda m: AvgKeep(m.index))
    ...
    attacker.close()  # (or use it as a context manager)

A rule applies to every message of its type that the node sends as a caller's request
(:meth:`Adversary.requests`) or as a handler's answer (:meth:`Adversary.answers`), optionally
only in calls of one method; it returns the message to send instead. :attr:`Adversary.rewritten`
counts the messages each rule changed, so a test can check that the attack happened.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from swarmavg.aio.node import Node
from swarmavg.proto.codec import Message

__all__ = ["Adversary"]

_M = TypeVar("_M", bound=Message)


class Adversary:
    """Rewrites what ``peer`` sends (see the module docstring).

    :param peer: a :class:`~swarmavg.aio.node.Node`, or anything with one as ``.node`` (an
        asyncio :class:`~swarmavg.aio.DHT`).
    :raises TypeError: ``peer`` has no node.
    :raises RuntimeError: another :class:`Adversary` rewrites that node's messages already.
    """

    def __init__(self, peer: Node | Any) -> None:
        node = peer if isinstance(peer, Node) else getattr(peer, "node", None)
        if not isinstance(node, Node):
            raise TypeError(f"peer must be a Node or have one as .node, not {peer!r:.60}")
        if node.rpc.rewrite is not None:
            raise RuntimeError("that node's messages are rewritten already")
        self.node = node
        #: (answer?, type) -> [(method or None, rule)]
        self._rules: dict[tuple[bool, type[Message]], list[tuple[str | None, Any]]] = {}
        #: how many messages were changed, by ``"request AvgBegin"`` / ``"answer AvgPart"``
        self.rewritten: Counter[str] = Counter()
        node.rpc.rewrite = self._rewrite

    def requests(
        self, kind: type[_M], rule: Callable[[_M], Message], *, method: str | None = None
    ) -> Adversary:
        """Send ``rule(message)`` instead of each request of type ``kind`` (in calls of
        ``method`` only, if given)."""
        return self._add(False, kind, rule, method)

    def answers(
        self, kind: type[_M], rule: Callable[[_M], Message], *, method: str | None = None
    ) -> Adversary:
        """Send ``rule(message)`` instead of each answer of type ``kind`` (to calls of
        ``method`` only, if given)."""
        return self._add(True, kind, rule, method)

    def _add(
        self, answer: bool, kind: type[Message], rule: Callable[[Any], Message], method: str | None
    ) -> Adversary:
        if not (isinstance(kind, type) and issubclass(kind, Message)):
            raise TypeError(f"kind must be a Message class, not {kind!r:.60}")
        self._rules.setdefault((answer, kind), []).append((method, rule))
        return self

    def _rewrite(self, method: str, message: Message, answer: bool) -> Message:
        for wanted, rule in self._rules.get((answer, type(message)), ()):
            if wanted is None or wanted == method:
                changed = rule(message)
                if changed is not message:
                    side = "answer" if answer else "request"
                    self.rewritten[f"{side} {type(message).__name__}"] += 1
                message = changed
        return message

    def close(self) -> None:
        """Send honestly again. Idempotent."""
        if self.node.rpc.rewrite == self._rewrite:
            self.node.rpc.rewrite = None

    def __enter__(self) -> Adversary:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
