"""The training workload of ``swarmavg.testing.workload``: a byte-level transformer on the
standard library's source, split by file, deterministic, and able to learn."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from swarmavg.testing import workload

MASK = (1 << 64) - 1


@pytest.fixture(scope="module")
def corpus() -> workload.Corpus:
    return workload.load_corpus()


@pytest.fixture(autouse=True)
def _one_thread() -> object:
    """One intra-op thread, as the benchmarks run (and the machine has 2 CPUs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- corpus ---------------------------------------------------------------------------------------


def _tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_corpus_skips_tests_site_packages_and_data_tables(tmp_path: Path) -> None:
    kept = {f"pkg{i}/mod{i}.py": f"x{i} = {i}\n".encode() * (50 + i) for i in range(12)}
    skipped = {
        "site-packages/foreign.py": b"FOREIGN\n",
        "dist-packages/foreign.py": b"FOREIGN\n",
        "test/test_x.py": b"FOREIGN\n",
        "pkg0/tests/test_y.py": b"FOREIGN\n",
        "idlelib/idle_test/t.py": b"FOREIGN\n",
        "encodings/cp000.py": b"FOREIGN\n",
        "pydoc_data/topics.py": b"FOREIGN\n",
        "pkg1/notes.txt": b"FOREIGN\n",
        "pkg2/__pycache__/mod2.py": b"FOREIGN\n",
    }
    _tree(tmp_path, kept | skipped)
    corpus = workload.load_corpus(root=tmp_path, max_bytes=None, validation_fraction=0.25)
    files = corpus.train_files + corpus.validation_files
    assert sorted(files) == sorted(kept)
    assert b"FOREIGN" not in corpus.train.tobytes() + corpus.validation.tobytes()
    assert corpus.train.size + corpus.validation.size == sum(map(len, kept.values()))


def test_split_is_by_file_disjoint_and_of_the_asked_share(corpus: workload.Corpus) -> None:
    assert set(corpus.train_files).isdisjoint(corpus.validation_files)
    assert len(corpus.validation_files) >= 5
    assert len(corpus.train_files) >= 5 * len(corpus.validation_files)
    for name in corpus.train_files + corpus.validation_files:
        assert name.endswith(".py")
        assert not {"test", "tests", "site-packages"} & set(Path(name).parts)
    # each split is exactly its files' bytes, in corpus order: no file straddles the split
    root = Path(corpus.root)
    for files, data in (
        (corpus.train_files, corpus.train),
        (corpus.validation_files, corpus.validation),
    ):
        assert b"".join((root / f).read_bytes() for f in files) == data.tobytes()
    total = corpus.train.size + corpus.validation.size
    assert 0.1 <= corpus.validation.size / total < 0.25
    assert total >= workload.DEFAULT_MAX_BYTES  # this stdlib has more than the cap
    assert total < workload.DEFAULT_MAX_BYTES + 300_000  # one file past it at most
    assert not corpus.train.flags.writeable


def test_corpus_is_cached_and_the_seed_chooses_the_split(corpus: workload.Corpus) -> None:
    assert workload.load_corpus() is corpus
    other = workload.load_corpus(seed=1)
    assert other.fingerprint != corpus.fingerprint
    assert set(other.validation_files) != set(corpus.validation_files)
    small = workload.load_corpus(max_files=10)
    assert len(small.train_files) + len(small.validation_files) == 10
    assert set(small.validation_files) <= set(corpus.validation_files)  # same order, a prefix


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_bytes": 0}, ValueError),
        ({"max_files": 1}, ValueError),
        ({"validation_fraction": 1.0}, ValueError),
        ({"validation_fraction": 0}, ValueError),
        ({"seed": 1.5}, TypeError),
    ],
)
def test_load_corpus_rejects_bad_arguments(kwargs: dict[str, object], error: type) -> None:
    with pytest.raises(error, match=next(iter(kwargs))):
        workload.load_corpus(**kwargs)  # type: ignore[arg-type]


# -- batches --------------------------------------------------------------------------------------


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_sample_offsets_are_splitmix64_of_the_index() -> None:
    """The stream is defined by integer arithmetic alone (no numpy or torch RNG), so it is the
    same under every version of both; this pins it."""
    key, length = 0x1234_5678_9ABC_DEF0, 1_000_003
    got = workload.sample_offsets(length, key, 5, 4).tolist()
    want = [_splitmix64((i * 0xD1B54A32D192ED03 + key) & MASK) % length for i in range(5, 9)]
    assert got == want


def test_batches_are_deterministic_windows_with_shifted_targets(corpus: workload.Corpus) -> None:
    first = [b for _, b in zip(range(3), workload.batches(corpus, 8, seed=3), strict=False)]
    again = [b for _, b in zip(range(3), workload.batches(corpus, 8, seed=3), strict=False)]
    for (x, y), (x2, y2) in zip(first, again, strict=True):
        assert x.shape == y.shape == (8, workload.CONTEXT)
        assert x.dtype == y.dtype == torch.long
        assert torch.equal(x, x2)
        assert torch.equal(y, y2)
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(first[0][0], first[1][0])  # the stream moves on
    # each row is a window of the training split
    train = corpus.train.tobytes()
    row = bytes(first[0][0][0].tolist()) + bytes([int(first[0][1][0][-1])])
    assert row in train
    # skipping ahead gives the same batch as iterating
    (x2, _) = next(workload.batches(corpus, 8, seed=3, first_step=2))
    assert torch.equal(x2, first[2][0])
    # other seeds and other peers draw other samples
    for kwargs in ({"seed": 4}, {"seed": 3, "peer": 1, "num_peers": 2}):
        x3, _ = next(workload.batches(corpus, 8, **kwargs))  # type: ignore[arg-type]
        assert not torch.equal(x3, first[0][0])


def test_sharded_peers_see_exactly_the_samples_of_one_large_batch(
    corpus: workload.Corpus,
) -> None:
    peers, b, steps = 4, 3, 5
    whole = workload.batches(corpus, peers * b, seed=7, sharded=True)
    parts = [
        workload.batches(corpus, b, seed=7, peer=p, num_peers=peers, sharded=True)
        for p in range(peers)
    ]
    for _ in range(steps):
        x, y = next(whole)
        pieces = [next(it) for it in parts]
        assert torch.equal(torch.cat([px for px, _ in pieces]), x)
        assert torch.equal(torch.cat([py for _, py in pieces]), y)
    # independent streams (the default) are not such a split
    mine = next(workload.batches(corpus, b, seed=7, peer=1, num_peers=peers))
    assert not torch.equal(mine[0], next(workload.batches(corpus, peers * b, seed=7))[0][b : 2 * b])


def test_validation_batches_come_from_validation_files(corpus: workload.Corpus) -> None:
    x, y = next(workload.batches(corpus, 4, split="validation", context=32))
    assert x.shape == (4, 32)
    window = bytes(x[0].tolist()) + bytes([int(y[0][-1])])
    assert window in corpus.validation.tobytes()


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": 2.0}, TypeError, "batch_size"),
        ({"batch_size": 2, "peer": 2, "num_peers": 2}, ValueError, "peer"),
        ({"batch_size": 2, "split": "test"}, ValueError, "split"),
        ({"batch_size": 2, "sharded": 1}, TypeError, "sharded"),
        ({"batch_size": 2, "context": 10**9}, ValueError, "context"),
    ],
)
def test_batches_rejects_bad_arguments(
    corpus: workload.Corpus, kwargs: dict[str, object], error: type, name: str
) -> None:
    with pytest.raises(error, match=name):
        workload.batches(corpus, **kwargs)  # type: ignore[arg-type]


# -- model and loss -------------------------------------------------------------------------------


def test_model_is_a_function_of_its_seed(corpus: workload.Corpus) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a, b, c = workload.make_model(0), workload.make_model(0), workload.make_model(1)
    assert torch.equal(torch.rand(3), expected_next)  # the global RNG was not touched
    assert sum(p.numel() for p in a.parameters()) == 137_216
    x, y = next(workload.batches(corpus, 16, seed=0))
    with torch.no_grad():
        loss_a, loss_b = workload.loss_fn(a, x, y), workload.loss_fn(b, x, y)
        assert float(loss_a) == float(loss_b)
        assert float(workload.loss_fn(c, x, y)) != float(loss_a)
    # near a uniform guess at the start
    assert abs(float(loss_a) - math.log(256)) < 0.1
    assert workload.evaluate(a, corpus) == workload.evaluate(b, corpus)


def test_model_is_causal() -> None:
    model = workload.make_model(0).eval()
    x = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    changed = x.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        out, out2 = model(x), model(changed)
    assert torch.equal(out[:, :10], out2[:, :10])
    assert not torch.allclose(out[:, 10:], out2[:, 10:])
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, workload.CONTEXT + 1, dtype=torch.long))


def test_make_model_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="heads"):
        workload.make_model(d_model=30, heads=4)
    with pytest.raises(ValueError, match="layers"):
        workload.make_model(layers=0)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_training_lowers_the_validation_loss(corpus: workload.Corpus) -> None:
    """150 Adam steps at batch 16: from ln 256 = 5.55 to 2.47 when measured (2 shared CPUs,
    torch 2.13); the bound leaves room for other torch versions and standard libraries."""
    model = workload.make_model(0)
    opt = workload.make_optimizer(model.parameters())
    initial = workload.evaluate(model, corpus)
    assert initial > 5.4
    for _, (x, y) in zip(range(150), workload.batches(corpus, 16, seed=0), strict=False):
        opt.zero_grad()
        workload.loss_fn(model, x, y).backward()
        opt.step()
    assert model.training
    final = workload.evaluate(model, corpus)
    assert model.training  # evaluate restored the mode
    assert final < 2.9, final


# -- packaging ------------------------------------------------------------------------------------


def test_workload_imports_nothing_of_swarmavg() -> None:
    """So that a script under another environment (hivemind's) can load it by file path."""
    source = Path(workload.__file__).read_text()
    modules: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0
            modules.add((node.module or "").split(".")[0])
    assert modules - set(sys.stdlib_module_names) == {"numpy", "torch"}


@pytest.mark.process
def test_swarmavg_testing_stays_torch_free() -> None:
    code = "import sys, swarmavg.testing; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"


def test_corpus_numpy_view_matches_sizes(corpus: workload.Corpus) -> None:
    assert corpus.train.dtype == np.uint8
    info = corpus.describe()
    assert info["train_bytes"] == corpus.train.size
    assert info["validation_files"] == len(corpus.validation_files)
