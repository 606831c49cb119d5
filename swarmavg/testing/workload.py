"""A small but real training task: a character-level transformer language model on the text of
Python's own standard library.

Every machine that runs Python has the corpus (no download), the model trains on two CPUs, and
everything is seeded, so tests, benchmarks, examples and the demo all use this one task::

    from swarmavg.testing import workload

    corpus = workload.load_corpus()                     # ~4 MiB of stdlib source, cached
    model = workload.make_model(seed=0)                 # 137k parameters
    opt = workload.make_optimizer(model.parameters())   # Adam, lr 2e-3
    for step, (x, y) in zip(range(150), workload.batches(corpus, 16, seed=0)):
        opt.zero_grad()
        workload.loss_fn(model, x, y).backward()
        opt.step()
    print(workload.evaluate(model, corpus))             # validation cross-entropy, nats/byte

The task:

- **Corpus** (:func:`load_corpus`): the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``
  (``root=`` for another tree), without ``site-packages``/``dist-packages``, test directories
  (``test``, ``tests``, ``idle_test``) and the data tables of ``encodings`` and ``pydoc_data``.
  Files are ordered by a hash of (``seed``, relative path) and taken in that order until
  ``max_bytes`` (default 4 MiB) are taken; the first of them make the validation split (until
  it holds ``validation_fraction`` of the bytes, default 10%), the others the training split.
  So the split is by file: no file is in both. Tokens are bytes (vocabulary 256); each split
  is its files' bytes joined.
  Loading reads ~4 MiB once (0.02-0.1 s here); the result is cached per process.
  The corpus depends on the Python version that provides the standard library:
  :attr:`Corpus.fingerprint` tells two of them apart (the benchmarks record it). On this
  machine (CPython 3.11.7): 608 files after the exclusions (9.5 MiB), of which 263 are taken
  (the 4 MiB cap): 28 files for validation (0.42 MiB), 235 for training (3.58 MiB).
- **Model** (:class:`TinyCharTransformer`, :func:`make_model`): a pre-norm decoder-only
  transformer: byte embedding + learned positions, ``layers`` blocks of causal self-attention
  (``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``) and a GELU MLP,
  final LayerNorm and a linear head to 256 logits. Defaults: context 64, ``d_model`` 64,
  2 layers, 4 heads, MLP width 256: 137,216 parameters (0.5 MiB of float32). Initialised from
  ``seed`` alone (torch's global RNG is left untouched), so every peer that makes the model with
  the same seed starts from the same parameters.
- **Batches** (:func:`batches`): windows of ``context + 1`` bytes at pseudo-random offsets of
  the training split, inputs ``x`` the first ``context`` bytes, targets ``y`` the next ones
  (``torch.long``, shape ``(batch_size, context)``). The offsets come from a counter-based hash
  (SplitMix64) of (seed, stream, sample index): the same on every machine, numpy and torch
  version, and any step can be computed without the ones before (``first_step=``). Each peer
  draws its own stream; with ``sharded=True`` the peers split one global stream instead, so that
  N peers with batch b see exactly the samples of one process with batch N*b.
- **Loss** (:func:`loss_fn`, :func:`evaluate`): mean cross-entropy in nats per byte; the
  validation loss is that over fixed validation windows (8 batches of 64 by default, 32,768
  predicted bytes), in eval mode without gradients. A uniform guess scores ln 256 = 5.545.

Measured here (2 shared CPUs, ``torch.set_num_threads(1)``, torch 2.13 CPU, CPython 3.11.7):
a training step (forward, backward, Adam) takes ~17 ms on a batch of 16 x 64, ~63 ms on
64 x 64 and ~360 ms on 256 x 64; :func:`evaluate` with its defaults ~0.15 s. The initial
validation loss is 5.53 (seed 0); Adam at lr 2e-3 (:func:`make_optimizer`) and batch 16 brings
it to 2.47 in 150 steps (~3 s), 2.30 in 300 and 2.07 in 600.

This module imports only torch, numpy and the standard library, and nothing of swarmavg, so that
a script running under another environment (hivemind's, for the benchmarks) can load it by file
path (``importlib.util.spec_from_file_location``). ``swarmavg.testing`` does not import it: that
package stays torch-free.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CONTEXT",
    "DEFAULT_LR",
    "DEFAULT_MAX_BYTES",
    "VOCAB_SIZE",
    "Corpus",
    "TinyCharTransformer",
    "batches",
    "evaluate",
    "load_corpus",
    "loss_fn",
    "make_model",
    "make_optimizer",
    "sample_offsets",
    "uniform_loss",
]

#: tokens are bytes
VOCAB_SIZE = 256
#: the model's default context length, in bytes
CONTEXT = 64
#: the corpus size :func:`load_corpus` takes by default, in bytes (both splits together)
DEFAULT_MAX_BYTES = 4 << 20
#: Adam's learning rate in :func:`make_optimizer`
DEFAULT_LR = 2e-3

#: directory names never descended into
_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "__pycache__",
        "test",
        "tests",
        "idle_test",
        "encodings",  # codec tables: mostly hex literals
        "pydoc_data",  # one 700 KB string of documentation
    }
)

_MASK64 = (1 << 64) - 1


# -- corpus ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """The two splits of the corpus (see the module docstring); treat it as read-only.

    :ivar train: the training split's bytes (a read-only ``numpy.uint8`` array).
    :ivar validation: the validation split's bytes.
    :ivar train_files: the training files' paths relative to ``root``, in corpus order.
    :ivar validation_files: the validation files' paths, likewise; disjoint from ``train_files``.
    :ivar root: the directory the files were read from.
    :ivar fingerprint: SHA-256 (hex) over the files' names and contents in both splits: equal
        fingerprints mean the same corpus.
    """

    train: np.ndarray[Any, np.dtype[np.uint8]]
    validation: np.ndarray[Any, np.dtype[np.uint8]]
    train_files: tuple[str, ...]
    validation_files: tuple[str, ...]
    root: str
    fingerprint: str

    def split(self, name: str) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The bytes of split ``name`` (``"train"`` or ``"validation"``).

        :raises ValueError: another name.
        """
        if name == "train":
            return self.train
        if name == "validation":
            return self.validation
        raise ValueError(f"split must be 'train' or 'validation', not {name!r:.64}")

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary: file and byte counts per split, root and fingerprint."""
        return {
            "root": self.root,
            "train_files": len(self.train_files),
            "validation_files": len(self.validation_files),
            "train_bytes": int(self.train.size),
            "validation_bytes": int(self.validation.size),
            "fingerprint": self.fingerprint,
        }


def _stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _python_files(root: Path) -> list[str]:
    """Relative POSIX paths of the ``.py`` files under ``root``, skipping ``_SKIP_DIRS``."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinked directories
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        rel = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.endswith(".py"):
                found.append((rel / name).as_posix())
    found.sort()
    return found


def _file_key(seed: int, rel: str) -> bytes:
    return hashlib.sha256(f"{seed}\0{rel}".encode()).digest()


def load_corpus(
    *,
    root: str | os.PathLike[str] | None = None,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    max_files: int | None = None,
    validation_fraction: float = 0.1,
    seed: int = 0,
) -> Corpus:
    """The corpus of ``.py`` files under ``root`` (default: this Python's standard library),
    split by file into training and validation (see the module docstring).

    :param root: the directory to read; default ``sysconfig.get_paths()["stdlib"]``.
    :param max_bytes: stop taking files once both splits together hold this many bytes (the
        file that crosses it is the last one taken); ``None``: every file.
    :param max_files: take at most this many files; ``None``: no limit.
    :param validation_fraction: the share of the taken bytes that goes to validation, in
        (0, 1): the first taken files make the validation split until it holds at least this
        share (whole files; at least one file is left for training).
    :param seed: chooses the files' order, hence the split and which files are taken.
    :returns: a :class:`Corpus`; calls with the same arguments return the same object.
    :raises TypeError: a bad argument (named).
    :raises ValueError: a bad argument (named).
    :raises OSError: ``root`` cannot be read.
    :raises ValueError: fewer than two files found, or a split would be empty.
    """
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0
    ):
        raise ValueError(f"max_bytes must be a positive int or None, not {max_bytes!r:.64}")
    if max_files is not None and (
        isinstance(max_files, bool) or not isinstance(max_files, int) or max_files < 2
    ):
        raise ValueError(f"max_files must be an int >= 2 or None, not {max_files!r:.64}")
    if (
        isinstance(validation_fraction, bool)
        or not isinstance(validation_fraction, int | float)
        or not 0 < validation_fraction < 1
    ):
        raise ValueError(
            f"validation_fraction must be a number in (0, 1), not {validation_fraction!r:.64}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, not {seed!r:.64}")
    resolved = os.path.realpath(os.fspath(root) if root is not None else _stdlib_root())
    return _load_corpus(resolved, max_bytes, max_files, float(validation_fraction), seed)


@functools.lru_cache(maxsize=8)
def _load_corpus(
    root: str, max_bytes: int | None, max_files: int | None, fraction: float, seed: int
) -> Corpus:
    base = Path(root)
    if not base.is_dir():
        raise OSError(f"root {root!r} is not a directory")
    files = _python_files(base)
    if len(files) < 2:
        raise ValueError(f"root {root!r} holds fewer than two .py files")
    files.sort(key=lambda rel: _file_key(seed, rel))
    sizes = {rel: (base / rel).stat().st_size for rel in files}
    total = sum(sizes.values())
    budget = total if max_bytes is None else min(max_bytes, total)
    taken: list[str] = []
    taken_bytes = 0
    for rel in files:
        if taken_bytes >= budget or (max_files is not None and len(taken) >= max_files):
            break
        if sizes[rel]:
            taken.append(rel)
            taken_bytes += sizes[rel]
    # the first taken files (in hash order) make the validation split, the others the training
    cut = 0
    held = 0
    while cut < len(taken) - 1 and held < fraction * taken_bytes:
        held += sizes[taken[cut]]
        cut += 1
    validation_files, train_files = taken[:cut], taken[cut:]
    if not validation_files or not train_files:
        raise ValueError(
            f"too few files for both splits ({len(taken)} taken); raise max_files or max_bytes"
        )
    digest = hashlib.sha256()

    def read(names: list[str], label: bytes) -> np.ndarray[Any, np.dtype[np.uint8]]:
        chunks: list[bytes] = []
        for rel in names:
            data = (base / rel).read_bytes()
            digest.update(label + rel.encode() + b"\0" + len(data).to_bytes(8, "big"))
            digest.update(data)
            chunks.append(data)
        return np.frombuffer(b"".join(chunks), dtype=np.uint8)  # over bytes: read-only

    validation = read(validation_files, b"v")
    train = read(train_files, b"t")
    return Corpus(
        train=train,
        validation=validation,
        train_files=tuple(train_files),
        validation_files=tuple(validation_files),
        root=root,
        fingerprint=digest.hexdigest(),
    )


# -- sampling -------------------------------------------------------------------------------------


def _splitmix64(values: np.ndarray[Any, np.dtype[np.uint64]]) -> np.ndarray[Any, Any]:
    """SplitMix64's finaliser applied elementwise (uint64 arithmetic wraps)."""
    z = values + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _stream_key(*parts: int) -> int:
    """A 64-bit key from small integers (any sign), mixed so that nearby tuples differ."""
    key = 0x2545F4914F6CDD1D
    for part in parts:
        key = int(_splitmix64(np.array([(key ^ (part & _MASK64)) & _MASK64], dtype=np.uint64))[0])
    return key


def sample_offsets(length: int, key: int, start: int, count: int) -> np.ndarray[Any, Any]:
    """Offsets ``[0, length)`` of samples ``start .. start+count-1`` of the stream ``key``:
    a pure function of its arguments (SplitMix64 of key + index, reduced modulo ``length``).

    :raises ValueError: ``length`` < 1, ``start`` or ``count`` < 0.
    """
    if length < 1 or start < 0 or count < 0:
        raise ValueError(f"bad range: length={length}, start={start}, count={count}")
    index = np.arange(start, start + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        mixed = _splitmix64(index * np.uint64(0xD1B54A32D192ED03) + np.uint64(key & _MASK64))
    return (mixed % np.uint64(length)).astype(np.int64)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {value!r:.64}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, not {value}")
    return value


def _windows(
    data: np.ndarray[Any, np.dtype[np.uint8]], offsets: np.ndarray[Any, Any], context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = data[offsets[:, None] + np.arange(context + 1)]
    tokens = torch.from_numpy(rows.astype(np.int64))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def batches(
    corpus: Corpus,
    batch_size: int,
    *,
    seed: int = 0,
    peer: int = 0,
    num_peers: int = 1,
    sharded: bool = False,
    context: int = CONTEXT,
    split: str = "train",
    first_step: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless, deterministic stream of batches ``(x, y)`` of split ``split``: ``x`` is
    ``batch_size`` windows of ``context`` bytes (``torch.long``, shape ``(batch_size,
    context)``) and ``y`` the same windows one byte later (the targets).

    :param seed: the stream's seed.
    :param peer: this peer's index in ``[0, num_peers)``.
    :param num_peers: how many peers draw batches.
    :param sharded: ``False`` (default): each peer draws its own stream, a function of
        (``seed``, ``peer``) alone. ``True``: the peers split one global stream of ``seed``:
        step k of peer p is samples ``[p*b, (p+1)*b)`` of the global batch k of size
        ``num_peers * b``, so the peers' batches of step k, concatenated in peer order, are
        exactly the batch k of ``batches(corpus, num_peers * b, seed=seed, sharded=True)``.
    :param context: the window length; the model's context at most.
    :param split: ``"train"`` or ``"validation"``.
    :param first_step: start at this step (the batches before it are skipped, not computed).
    :raises TypeError: a bad argument (named).
    :raises ValueError: a bad argument (named), also when the split is shorter than
        ``context + 1`` bytes. Raised by the call, not at the first ``next()``.
    """
    _check_int("batch_size", batch_size, 1)
    _check_int("seed", seed, -(1 << 63))
    _check_int("num_peers", num_peers, 1)
    _check_int("peer", peer, 0)
    if peer >= num_peers:
        raise ValueError(f"peer must be in [0, num_peers={num_peers}), not {peer}")
    _check_int("context", context, 1)
    _check_int("first_step", first_step, 0)
    if not isinstance(sharded, bool):
        raise TypeError(f"sharded must be a bool, not {sharded!r:.64}")
    data = corpus.split(split)
    positions = data.size - context
    if positions < 1:
        raise ValueError(f"the {split} split ({data.size} bytes) is shorter than context + 1")
    return _batches(
        data, positions, batch_size, seed, peer, num_peers, sharded, context, first_step
    )


def _batches(
    data: np.ndarray[Any, np.dtype[np.uint8]],
    positions: int,
    batch_size: int,
    seed: int,
    peer: int,
    num_peers: int,
    sharded: bool,
    context: int,
    step: int,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    if sharded:
        key = _stream_key(seed, -1)
        stride, shift = num_peers * batch_size, peer * batch_size
    else:
        key = _stream_key(seed, peer)
        stride, shift = batch_size, 0
    while True:
        yield _windows(
            data, sample_offsets(positions, key, step * stride + shift, batch_size), context
        )
        step += 1


# -- model ----------------------------------------------------------------------------------------


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, d_model: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        qkv = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = h + self.fc2(F.gelu(self.fc1(self.norm2(h))))
        return out


class TinyCharTransformer(nn.Module):
    """A decoder-only byte-level transformer (see the module docstring); ``forward(x)`` maps
    ``x`` of shape ``(batch, t)`` (``t <= context``, ``torch.long`` in ``[0, 256)``) to logits
    of shape ``(batch, t, 256)``.

    Use :func:`make_model` for a seeded instance.
    """

    def __init__(
        self,
        *,
        context: int = CONTEXT,
        d_model: int = 64,
        layers: int = 2,
        heads: int = 4,
        hidden: int | None = None,
    ) -> None:
        super().__init__()
        _check_int("context", context, 1)
        _check_int("d_model", d_model, 1)
        _check_int("layers", layers, 1)
        _check_int("heads", heads, 1)
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
        hidden = 4 * d_model if hidden is None else _check_int("hidden", hidden, 1)
        self.context = context
        self.embed = nn.Embedding(VOCAB_SIZE, d_model)
        self.position = nn.Parameter(torch.zeros(context, d_model))
        self.blocks = nn.ModuleList(_Block(d_model, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE)
        for module in self.modules():  # GPT-2's initialisation: logits start near uniform
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.context:
            raise ValueError(f"input length {t} exceeds the model's context {self.context}")
        h = self.embed(x) + self.position[:t]
        for block in self.blocks:
            h = block(h)
        logits: torch.Tensor = self.head(self.norm(h))
        return logits


def make_model(
    seed: int = 0,
    *,
    context: int = CONTEXT,
    d_model: int = 64,
    layers: int = 2,
    heads: int = 4,
    hidden: int | None = None,
) -> TinyCharTransformer:
    """A :class:`TinyCharTransformer` (float32, CPU, training mode) whose initial parameters
    are a function of ``seed`` and the sizes alone; torch's global RNG state is left as it was.

    :param hidden: the MLP's width; default ``4 * d_model``.
    :raises TypeError: a bad argument (named).
    :raises ValueError: a bad argument (named).
    """
    _check_int("seed", seed, -(1 << 63))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyCharTransformer(
            context=context, d_model=d_model, layers=layers, heads=heads, hidden=hidden
        )


def make_optimizer(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], *, lr: float = DEFAULT_LR
) -> torch.optim.Optimizer:
    """The task's inner optimizer: ``torch.optim.Adam(params, lr=lr)``. Usable as the
    ``optimizer=`` factory of ``swarmavg.Optimizer`` / ``hivemind.Optimizer``."""
    return torch.optim.Adam(params, lr=lr)


# -- loss -----------------------------------------------------------------------------------------


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats per byte) of ``model``'s predictions of ``y`` from ``x``."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def evaluate(
    model: nn.Module,
    corpus: Corpus,
    *,
    num_batches: int = 8,
    batch_size: int = 64,
    seed: int = 0,
    context: int | None = None,
) -> float:
    """Validation cross-entropy (nats per byte) of ``model`` over ``num_batches`` fixed batches
    of the validation split (a function of ``seed``, ``batch_size`` and ``context``: the same
    windows at every call), computed in eval mode without gradients; the model's training mode
    is restored afterwards.

    :param context: the window length; default the model's ``context`` attribute, else
        :data:`CONTEXT`.
    :raises TypeError: a bad argument (named).
    :raises ValueError: a bad argument (named).
    """
    _check_int("num_batches", num_batches, 1)
    if context is None:
        context = int(getattr(model, "context", CONTEXT))
    stream = batches(corpus, batch_size, seed=seed, context=context, split="validation")
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        with torch.no_grad():
            for _, (x, y) in zip(range(num_batches), stream, strict=False):
                total += float(loss_fn(model, x, y))
    finally:
        model.train(was_training)
    return total / num_batches


def uniform_loss() -> float:
    """The cross-entropy of a uniform guess over the vocabulary: ln 256."""
    return math.log(VOCAB_SIZE)
