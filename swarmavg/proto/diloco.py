"""DiLoCo's rounds and epochs (sans-IO): when to synchronize, what a round's outcome does.

Theory of operation
-------------------
DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
2023) trains with two optimizers. Each peer takes ``sync_every`` (H) steps of its *inner*
optimizer on its own data, from the parameters every peer shares, θ_global; then the peers
average their *pseudo-gradients* Δ = θ_global − θ_local (that sign, spec R-E1) and each one
takes the same step of its *outer* optimizer from θ_global on the mean Δ̄. The result is the
next θ_global, and the next *outer epoch* begins.

:class:`DiLoCoSchedule` is the bookkeeping of one peer, with no torch, network or clock of its
own:

* ``inner_step`` counts the inner steps since θ_global (the local progress the parameters
  hold); every ``sync_every``-th one makes a round due (:meth:`DiLoCoSchedule.inner_step_done`);
* the *global step* ``outer_epoch · sync_every + inner_step`` drives the inner learning-rate
  schedule, so a peer that downloaded the state of epoch ``e`` continues the schedule where
  the swarm is (spec R-E7, which OpenDiLoCo gets wrong);
* :meth:`DiLoCoSchedule.plan_round` decides what a due round does: ``"behind"`` (another peer
  is at a later outer epoch: this peer's θ_global is stale, the round fails and the caller
  downloads the state), ``"alone"`` (no other peer reports progress in the run: the peer
  applies its own Δ, as OpenDiLoCo does) or ``"average"``;
* each member of a round sends its outer epoch and a digest of its θ_global along
  (:func:`gather_payload`); :meth:`DiLoCoSchedule.check_round` reads what the members sent:
  ``"behind"`` (a member is at a later epoch), ``"diverged"`` (this peer's θ_global is not the
  round's *reference*: the one held by the member with the lowest PeerID among those at the
  highest epoch) or ``"agree"``. Peers that started from other weights, or that each took a
  first round alone, hold different θ_global at the same epoch; averaging Δ would keep them
  apart forever. After such a round the reference member (and every member whose θ_global is
  the reference's) takes the outer step, and the others roll back and download the state of
  the next epoch: one θ_global again, without a second round. It cannot loop: the reference
  never changes its state because of the others, and a peer whose download fails is behind
  (or diverged) again in its next round;
* :meth:`DiLoCoSchedule.round_succeeded` moves to the next outer epoch;
  :meth:`DiLoCoSchedule.round_failed` applies ``on_round_failure``: ``"rollback"`` (back to
  θ_global, the local progress is discarded, as torchft does after a failed commit) or
  ``"keep_local"`` (the parameters keep θ_local; the next round's Δ holds both rounds' steps);
  the epoch does not move either way;
* :meth:`DiLoCoSchedule.state_loaded` takes a downloaded outer epoch; failed downloads back off
  (:meth:`DiLoCoSchedule.should_load_state`, on the caller's clock, ``now`` in seconds).

Every round, whatever its outcome, leaves a :class:`RoundReport` in
:attr:`DiLoCoSchedule.last_round` and in the counters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

__all__ = [
    "DIGEST_SIZE",
    "FAILURE_POLICIES",
    "WEIGHTINGS",
    "DiLoCoSchedule",
    "RoundAction",
    "RoundCheck",
    "RoundOutcome",
    "RoundPlan",
    "RoundReport",
    "epoch_group_bits",
    "gather_payload",
    "parse_gathered",
    "round_weight",
]

#: What a failed round does with the parameters.
FAILURE_POLICIES: Final = ("rollback", "keep_local")
#: How a peer's Δ is weighted in the mean.
WEIGHTINGS: Final = ("equal", "samples")
#: Backoff after a failed state download: first wait, longest wait (seconds).
LOAD_BACKOFF: Final = (1.0, 60.0)

#: Bytes of a θ_global digest in a round's gathered metadata.
DIGEST_SIZE: Final = 16

RoundPlan: TypeAlias = Literal["average", "alone", "behind"]
RoundOutcome: TypeAlias = Literal["averaged", "alone", "failed"]
RoundAction: TypeAlias = Literal["outer_step", "rollback", "keep_local"]
RoundVerdict: TypeAlias = Literal["agree", "behind", "diverged"]


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What one round did.

    :ivar epoch: the outer epoch the round began at.
    :ivar outcome: ``"averaged"`` (with ``group_size − 1`` other peers), ``"alone"`` (no
        other peer in the run: its own Δ) or ``"failed"``.
    :ivar action: what happened to the parameters: ``"outer_step"`` (a new θ_global),
        ``"rollback"`` (back to θ_global) or ``"keep_local"`` (θ_local kept).
    :ivar group_size: the peers whose Δ went into the mean, this one included (1 alone, 0 when
        the round failed).
    :ivar inner_steps: the inner steps since θ_global that the round's Δ held.
    :ivar error: why the round failed (``None`` otherwise).
    :ivar seconds: how long the round took (set by the caller; 0 when not measured).
    """

    epoch: int
    outcome: RoundOutcome
    action: RoundAction
    group_size: int
    inner_steps: int
    error: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class RoundCheck:
    """What the members of an averaged round sent, as one peer reads it.

    :ivar verdict: ``"agree"`` (this peer holds the reference θ_global: take the outer step),
        ``"behind"`` (a member is at a later outer epoch) or ``"diverged"`` (same epoch,
        another θ_global than the reference's: roll back and download the next epoch's state).
    :ivar reference: the member whose θ_global the round keeps (the lowest PeerID among the
        members at the highest epoch), ``None`` when no member sent a valid payload.
    :ivar diverged: the members at the highest epoch whose θ_global is not the reference's.
    """

    verdict: RoundVerdict
    reference: bytes | None
    diverged: int


#: Bits of the outer epoch in a round's group key (epochs this far apart never meet anyway).
EPOCH_BITS: Final = 16


def epoch_group_bits(outer_epoch: int) -> str:
    """The matchmaking group bits of a round at ``outer_epoch``: its low :data:`EPOCH_BITS`
    bits, so that peers at different outer epochs look for groups under different keys.

    :raises ValueError: a negative epoch.
    """
    epoch = _check_count("outer_epoch", outer_epoch, 0)
    return format(epoch % (1 << EPOCH_BITS), f"0{EPOCH_BITS}b")


def gather_payload(outer_epoch: int, digest: bytes) -> dict[str, object]:
    """What a peer sends with its Δ: its outer epoch and the digest of its θ_global
    (``DIGEST_SIZE`` bytes)."""
    return {"epoch": outer_epoch, "theta": digest}


def parse_gathered(value: object) -> tuple[int, bytes] | None:
    """``(outer_epoch, digest)`` from a member's gathered metadata (from the network), or
    ``None`` when it is not a mapping with an int ``epoch`` ≥ 0 and a ``DIGEST_SIZE``-byte
    ``theta``."""
    if not isinstance(value, dict):
        return None
    epoch, digest = value.get("epoch"), value.get("theta")
    if type(epoch) is not int or epoch < 0:  # (not a bool)
        return None
    if not isinstance(digest, bytes) or len(digest) != DIGEST_SIZE:
        return None
    return epoch, digest


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {value!r:.40}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, not {value}")
    return value


def round_weight(weighting: str, inner_steps: int, batch_size: int) -> float:
    """A peer's weight in a round's mean: 1 (``"equal"``, DiLoCo's and torchft's rule) or the
    samples its Δ holds (``"samples"``: ``inner_steps · batch_size``).

    :raises ValueError: an unknown ``weighting``.
    """
    if weighting == "equal":
        return 1.0
    if weighting == "samples":
        return float(inner_steps * batch_size)
    raise ValueError(f"weighting must be one of {WEIGHTINGS}, not {weighting!r:.40}")


class DiLoCoSchedule:
    """One peer's DiLoCo bookkeeping: inner steps, outer epochs, the outcome of rounds.

    :param sync_every: inner steps per round (H, an int ≥ 1).
    :param on_round_failure: ``"rollback"`` or ``"keep_local"`` (see the module's docstring).
    :param outer_epoch: the epoch to start at (≥ 0).
    :raises TypeError: an argument has the wrong type (named).
    :raises ValueError: an argument is out of range (named).
    """

    def __init__(
        self, sync_every: int, on_round_failure: str = "rollback", outer_epoch: int = 0
    ) -> None:
        self.sync_every = _check_count("sync_every", sync_every, 1)
        if on_round_failure not in FAILURE_POLICIES:
            raise ValueError(
                f"on_round_failure must be one of {FAILURE_POLICIES}, not {on_round_failure!r:.40}"
            )
        self.on_round_failure = on_round_failure
        self.outer_epoch = _check_count("outer_epoch", outer_epoch, 0)
        #: inner steps since θ_global
        self.inner_step = 0
        self.last_round: RoundReport | None = None
        self.rounds_averaged = 0
        self.rounds_alone = 0
        self.rounds_failed = 0
        #: failed rounds in which this peer's θ_global was not the round's reference
        self.rounds_diverged = 0
        self.state_loads = 0
        #: downloads that failed (or were refused), in all
        self.state_load_failures = 0
        self._load_failures = 0
        self._load_not_before = -math.inf

    @property
    def global_step(self) -> int:
        """``outer_epoch · sync_every + inner_step``: where the inner schedule is."""
        return self.outer_epoch * self.sync_every + self.inner_step

    @property
    def round_due(self) -> bool:
        """Whether the inner steps since θ_global end a round (a multiple of ``sync_every``,
        at least one)."""
        return self.inner_step > 0 and self.inner_step % self.sync_every == 0

    def inner_step_done(self) -> bool:
        """Count one inner step; whether a round is due now."""
        self.inner_step += 1
        return self.round_due

    def plan_round(self, num_peers: int, global_epoch: int, now: float | None = None) -> RoundPlan:
        """What the due round does, given the run's progress records: ``num_peers`` (the
        peers with a live record, this one included if it published) and ``global_epoch``
        (the highest outer epoch among them).

        With ``now`` (the caller's clock, as for :meth:`should_load_state`), a peer behind
        the records is ``"behind"`` only when it may try a download: while a failed one asks
        to wait, it averages with the peers at hand (a record ahead may be a killed peer's,
        lingering until it expires, or one whose state no donor delivers: failing every round
        until then would stop this peer). A groupmate at a later epoch still fails the round
        (:meth:`check_round`).

        :raises RuntimeError: no round is due.
        """
        if not self.round_due:
            raise RuntimeError(f"no round is due at inner step {self.inner_step}")
        if global_epoch > self.outer_epoch and (now is None or now >= self._load_not_before):
            return "behind"
        if num_peers <= 1:
            return "alone"
        return "average"

    def check_round(self, gathered: Mapping[bytes, object], digest: bytes) -> RoundCheck:
        """Read an averaged round's gathered metadata: ``gathered`` maps each member's PeerID
        (bytes) to what it sent (:func:`gather_payload`; malformed values are ignored);
        ``digest`` is this peer's θ_global digest at :attr:`outer_epoch`.

        The reference is the member with the lowest PeerID among those at the highest epoch.
        Every member sees the same metadata, so every member picks the same reference.
        """
        members = {
            peer: parsed for peer, raw in gathered.items() if (parsed := parse_gathered(raw))
        }
        if not members:
            return RoundCheck("agree", None, 0)
        top = max(epoch for epoch, _ in members.values())
        if top > self.outer_epoch:
            return RoundCheck("behind", None, 0)
        at_top = sorted(peer for peer, (epoch, _) in members.items() if epoch == top)
        reference = at_top[0]
        kept = members[reference][1]
        diverged = sum(1 for peer in at_top if members[peer][1] != kept)
        if top < self.outer_epoch or digest == kept:
            # (every member is behind us: they fail their round, ours stands)
            return RoundCheck("agree", reference, diverged)
        return RoundCheck("diverged", reference, diverged)

    def round_succeeded(self, *, alone: bool, group_size: int, seconds: float = 0.0) -> RoundReport:
        """The outer step was taken: next epoch, no local progress."""
        report = RoundReport(
            epoch=self.outer_epoch,
            outcome="alone" if alone else "averaged",
            action="outer_step",
            group_size=1 if alone else group_size,
            inner_steps=self.inner_step,
            seconds=seconds,
        )
        if alone:
            self.rounds_alone += 1
        else:
            self.rounds_averaged += 1
        self.outer_epoch += 1
        self.inner_step = 0
        self.last_round = report
        return report

    def round_failed(
        self, error: str, seconds: float = 0.0, *, diverged: bool = False
    ) -> RoundReport:
        """The round failed: ``on_round_failure`` says what the parameters do (the report's
        ``action``); the epoch stays; with ``"rollback"`` the local progress is gone.
        ``diverged``: the round averaged, but this peer's θ_global was not the reference
        (:meth:`check_round`): its Δ is in the others' next θ_global already, so it always
        rolls back (and counts in :attr:`rounds_diverged` too)."""
        rollback = diverged or self.on_round_failure == "rollback"
        action: RoundAction = "rollback" if rollback else "keep_local"
        report = RoundReport(
            epoch=self.outer_epoch,
            outcome="failed",
            action=action,
            group_size=0,
            inner_steps=self.inner_step,
            error=error,
            seconds=seconds,
        )
        self.rounds_failed += 1
        if diverged:
            self.rounds_diverged += 1
        if action == "rollback":
            self.inner_step = 0
        self.last_round = report
        return report

    # -- catching up -----------------------------------------------------------------------------

    def should_load_state(self, global_epoch: int, now: float) -> bool:
        """Whether to download the state now: another peer is at a later epoch and no failed
        download asks to wait (``now``: the caller's clock, seconds)."""
        return global_epoch > self.outer_epoch and now >= self._load_not_before

    def state_loaded(self, outer_epoch: int) -> None:
        """A downloaded state of ``outer_epoch`` was taken: θ_global is the swarm's, no local
        progress.

        :raises ValueError: ``outer_epoch`` is negative.
        """
        self.outer_epoch = _check_count("outer_epoch", outer_epoch, 0)
        self.inner_step = 0
        self.state_loads += 1
        self._load_failures = 0
        self._load_not_before = -math.inf

    def restore(self, outer_epoch: int, inner_step: int) -> None:
        """Continue from a checkpoint: ``outer_epoch`` and the ``inner_step`` steps taken
        since its θ_global (both ints ≥ 0; ``inner_step`` below :attr:`sync_every`, since a
        due round ends before a checkpoint can be taken). The counters are kept.

        :raises TypeError: an argument is not an int (named).
        :raises ValueError: an argument is out of range (named).
        """
        epoch = _check_count("outer_epoch", outer_epoch, 0)
        step = _check_count("inner_step", inner_step, 0)
        if step >= self.sync_every:
            raise ValueError(f"inner_step must be below sync_every ({self.sync_every}), not {step}")
        self.outer_epoch, self.inner_step = epoch, step
        self._load_failures = 0
        self._load_not_before = -math.inf

    def state_load_failed(self, now: float) -> float:
        """A download failed at ``now``: the next one waits, doubling from
        ``LOAD_BACKOFF[0]`` up to ``LOAD_BACKOFF[1]`` seconds. Returns the wait."""
        self._load_failures += 1
        self.state_load_failures += 1
        wait = min(LOAD_BACKOFF[0] * 2.0 ** (self._load_failures - 1), LOAD_BACKOFF[1])
        self._load_not_before = now + wait
        return wait

    def __repr__(self) -> str:
        return (
            f"<DiLoCoSchedule H={self.sync_every} epoch={self.outer_epoch} "
            f"inner_step={self.inner_step} {self.on_round_failure}>"
        )
