"""The accumulator's user state as msgpack plus tensors: what fits, what is refused (naming
where), and skeletons from the network that are refused."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from swarmavg.proto.accumulator_state import MAX_STATE_DEPTH, join_state, split_state
from swarmavg.proto.state_messages import StateDownloadFailed


def torch_dtype(obj: object) -> str | None:
    if not isinstance(obj, torch.Tensor):
        return None
    if obj.layout != torch.strided:
        return "a sparse tensor"
    return str(obj.dtype).removeprefix("torch.")


def roundtrip(state: object) -> object:
    skeleton, tensors = split_state(state, torch_dtype)
    return join_state(skeleton, tensors)


def test_an_optimizer_state_dict_fits_and_comes_back_equal() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), betas=(0.8, 0.9))
    model(torch.randn(5, 3)).pow(2).sum().backward()
    opt.step()
    state: Any = {"optimizer": opt.state_dict(), "epoch": 3, "rng": np.arange(4, dtype=np.int64)}
    skeleton, tensors = split_state(state, torch_dtype)
    assert isinstance(skeleton, bytes)
    # step, exp_avg, exp_avg_sq per parameter, and the array
    assert len(tensors) == 3 * 4 + 1
    back: Any = join_state(skeleton, tensors)
    assert back["epoch"] == 3
    assert type(back["rng"]) is np.ndarray
    assert back["rng"].tolist() == [0, 1, 2, 3]
    groups = back["optimizer"]["param_groups"]
    assert groups == state["optimizer"]["param_groups"]
    assert groups[0]["betas"] == (0.8, 0.9)
    assert type(groups[0]["betas"]) is tuple
    fresh = torch.optim.Adam(model.parameters())
    fresh.load_state_dict(back["optimizer"])
    for (i, mine), theirs in zip(opt.state.items(), fresh.state.values(), strict=True):
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[name], theirs[name]), (i, name)


def test_scalars_keys_tuples_and_arrays_keep_their_types() -> None:
    state: Any = {
        "s": "x",
        1: None,
        2.5: True,
        None: b"raw",
        b"k": [1, (2, (3,)), [], ()],
        False: -(1 << 63),
        "big": (1 << 64) - 1,
        "f": float("inf"),
        "t": torch.tensor([1.5, 2.0], dtype=torch.bfloat16),
        "a": np.zeros((2, 0), dtype=np.float16),
    }
    back: Any = roundtrip(state)
    assert set(back) == set(state)
    assert back[b"k"] == [1, (2, (3,)), [], ()]
    assert type(back[b"k"][1]) is tuple
    assert type(back[b"k"][3]) is tuple
    assert back[2.5] is True
    assert back[None] == b"raw"
    assert back[False] == -(1 << 63)
    assert back["big"] == (1 << 64) - 1
    assert back["f"] == float("inf")
    assert torch.equal(back["t"], state["t"])
    assert back["a"].dtype == np.float16
    assert back["a"].shape == (2, 0)


def test_a_dict_whose_keys_look_like_a_tuple_marker_stays_a_dict() -> None:
    assert roundtrip({3: []}) == {3: []}
    assert roundtrip([{}]) == [{}]


@pytest.mark.parametrize(
    ("state", "where", "what"),
    [
        (
            {"optimizer": {"state": {0: {"step": object()}}}},
            "state['optimizer']['state'][0]['step']",
            "object",
        ),
        ([1, {"f": lambda: 0}], "state[1]['f']", "function"),
        ({"s": {1, 2}}, "state['s']", "set"),
        ({"c": 1j}, "state['c']", "complex"),
        ((namedtuple("P", "x")(1),), "state[0]", "P"),  # type: ignore[arg-type]
        ({"a": np.array([object()])}, "state['a']", "array of object"),
        ({"t": torch.zeros(2, dtype=torch.uint16)}, "state['t']", "uint16"),
        ({"t": torch.zeros(2).to_sparse()}, "state['t']", "sparse"),
        ({(1, 2): 0}, "state", "key of type tuple"),
        ({"k": {torch.zeros(1): 0}}, "state['k']", "key of type Tensor"),
    ],
)
def test_anything_else_raises_type_error_naming_where(state: object, where: str, what: str) -> None:
    with pytest.raises(TypeError) as info:
        split_state(state, torch_dtype)
    message = str(info.value)
    assert message.startswith(where + " "), message
    assert what in message


def test_ints_out_of_range_and_cycles_are_refused() -> None:
    with pytest.raises(ValueError, match=r"state\['n'\] is an int out of the 64-bit range"):
        split_state({"n": 1 << 64}, torch_dtype)
    with pytest.raises(ValueError, match="int key"):
        split_state({-(1 << 63) - 1: 0}, torch_dtype)
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(TypeError, match="nests deeper"):
        split_state(cycle, torch_dtype)
    deep: Any = 0
    for _ in range(MAX_STATE_DEPTH):
        deep = [deep]
    assert split_state(deep, torch_dtype)[1] == []  # the limit itself fits
    with pytest.raises(TypeError, match="nests deeper"):
        split_state([deep], torch_dtype)


def test_root_names_the_argument() -> None:
    with pytest.raises(TypeError, match=r"^obj\[0\] is a builtins.object"):
        split_state([object()], torch_dtype, root="obj")


def ext(code: int, index: int) -> msgpack.ExtType:
    return msgpack.ExtType(code, index.to_bytes(4, "big"))


@pytest.mark.parametrize(
    ("skeleton", "tensors", "match"),
    [
        (b"\xc1", [], "does not decode"),  # a reserved byte
        (b"\x92\x01", [], "does not decode"),  # truncated
        (msgpack.packb([ext(1, 1)]), [torch.zeros(1)], "uses tensor 1"),
        (msgpack.packb([ext(1, 0), ext(1, 0)]), [torch.zeros(1)], "uses tensor 0"),
        (msgpack.packb([ext(1, 0)]), [torch.zeros(1), torch.zeros(1)], "every tensor"),
        (msgpack.packb([msgpack.ExtType(9, b"\0\0\0\0")]), [torch.zeros(1)], "unknown"),
        (msgpack.packb([msgpack.ExtType(1, b"\0")]), [torch.zeros(1)], "unknown"),
        (msgpack.packb({msgpack.ExtType(3, b""): 5}), [], "malformed tuple"),
        (msgpack.packb({msgpack.ExtType(1, b""): 5, "x": 1}), [], "key"),
        (b"\x91" * (MAX_STATE_DEPTH + 1) + b"\xc0", [], "deeper"),
        (b"\x91" * 5000 + b"\xc0", [], "does not decode|deeper"),
    ],
)
def test_bad_skeletons_from_the_network_are_refused(
    skeleton: bytes, tensors: list[Any], match: str
) -> None:
    with pytest.raises(StateDownloadFailed, match=match):
        join_state(skeleton, tensors)


def test_a_skeleton_of_the_depth_limit_decodes() -> None:
    assert join_state(b"\x91" * MAX_STATE_DEPTH + b"\xc0", []) is not None
