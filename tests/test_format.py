"""Round trips of states through the object tree and tensor list of tiercache.format."""

from __future__ import annotations

import base64
import collections
import dataclasses
import enum
import json
import math
import pickle
import struct
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pydantic_core
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache.errors import IntegrityError, UnsupportedStateError
from tiercache.format import Flat, TensorMeta, dtype_from_name, dtype_name, flatten, unflatten

DTYPE_NAMES = [
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "complex128", "complex64", "complex32",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
]

# The manifest goes through pydantic's JSON; user code may use the stdlib: both must round-trip.
JSON_CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "stdlib": (lambda tree: json.dumps(tree, allow_nan=False), json.loads),
    "pydantic": (pydantic_core.to_json, pydantic_core.from_json),
}


def stored(t: torch.Tensor) -> torch.Tensor:
    """What a tier gives back: a fresh contiguous tensor holding the same bytes."""
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(t)
    return out


def roundtrip(state: Any, *, allow_pickle: bool = False, codec: str = "stdlib") -> tuple[Flat, Any]:
    flat = flatten(state, allow_pickle=allow_pickle)
    dumps, loads = JSON_CODECS[codec]
    tree = loads(dumps(flat.tree))
    return flat, unflatten(tree, [stored(t) for t in flat.tensors], allow_pickle=allow_pickle)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def float_bits(x: float) -> bytes:
    return struct.pack(">d", x)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Type-exact, bit-exact equality (NaN payloads, -0.0, key types and key order count)."""
    if isinstance(a, torch.Tensor):
        assert type(b) is torch.Tensor, path
        assert not b.requires_grad, path
        assert (b.dtype, b.shape) == (a.dtype, a.shape), path
        assert tensor_bytes(b) == tensor_bytes(a), path
        return
    assert type(b) is type(a), f"{path}: {type(b)} is not {type(a)}"
    if isinstance(a, dict):
        assert len(b) == len(a), path
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            assert_same(ka, kb, f"{path}/<key {ka!r}>")
            assert_same(va, vb, f"{path}/{ka}")
        assert hasattr(b, "_metadata") == hasattr(a, "_metadata"), path
        if hasattr(a, "_metadata"):
            assert_same(a._metadata, b._metadata, f"{path}/_metadata")
    elif isinstance(a, (list, tuple)):
        assert len(b) == len(a), path
        for i, (va, vb) in enumerate(zip(a, b, strict=True)):
            assert_same(va, vb, f"{path}/{i}")
    elif isinstance(a, float):
        assert float_bits(b) == float_bits(a), path
    elif isinstance(a, complex):
        assert (float_bits(b.real), float_bits(b.imag)) == (float_bits(a.real), float_bits(a.imag)), path
    else:
        assert b == a, path


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of random bytes (so NaN payloads, -0.0 and subnormals occur) of any dtype."""
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype is torch.bool:
        return torch.randint(0, 2, (n,), generator=gen, dtype=torch.uint8).bool().reshape(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


# ---------------------------------------------------------------------------------------------
# tensors


@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("codec", sorted(JSON_CODECS))
def test_every_dtype_and_shape_roundtrips_bit_exact(name: str, codec: str) -> None:
    dtype = getattr(torch, name)
    base = random_tensor(dtype, (4, 6, 3), seed=len(name))
    state = {
        "scalar": random_tensor(dtype, (), seed=1),
        "empty": random_tensor(dtype, (0,)),
        "empty3d": random_tensor(dtype, (3, 0, 2)),
        "dense": base,
        "transposed": base.transpose(0, 2),
        "strided": base[::2, 1::3],
        "expanded": random_tensor(dtype, (1, 3), seed=2).expand(5, 3),
    }
    flat, out = roundtrip(state, codec=codec)
    assert_same(state, out)
    assert [m.dtype for m in flat.metas] == [name] * len(state)
    assert [m.path for m in flat.metas] == list(state)
    assert [m.shape for m in flat.metas] == [tuple(t.shape) for t in state.values()]
    assert [m.nbytes for m in flat.metas] == [t.numel() * dtype.itemsize for t in state.values()]
    assert flat.pickled is False


def test_flatten_returns_the_original_tensors_without_copying() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base.t()[1:3]
    flat = flatten({"a": base, "b": [view]})
    assert flat.tensors[0] is base
    assert flat.tensors[1] is view
    assert flat.tensors[1].data_ptr() == view.data_ptr()


def test_parameter_and_grad_tensors_are_stored_as_plain_detached_tensors() -> None:
    param = torch.nn.Parameter(torch.randn(3, 2))
    nonleaf = param * 2
    flat, out = roundtrip({"p": param, "q": nonleaf})
    assert [type(t) for t in flat.tensors] == [torch.Tensor, torch.Tensor]
    assert [t.requires_grad for t in flat.tensors] == [False, False]
    assert flat.tensors[0].data_ptr() == param.data_ptr()
    assert type(out["p"]) is torch.Tensor
    assert torch.equal(out["p"], param.detach())
    assert torch.equal(out["q"], nonleaf.detach())


def test_conj_and_neg_views_store_their_values() -> None:
    z = torch.tensor([1 + 2j, -3 - 0.5j], dtype=torch.complex64)
    flat, out = roundtrip({"conj": z.conj(), "neg": z.conj().imag})
    assert tensor_bytes(out["conj"]) == tensor_bytes(z.conj().resolve_conj())
    assert torch.equal(out["neg"], torch.tensor([-2.0, 0.5]))
    assert [t.is_conj() or t.is_neg() for t in flat.tensors] == [False, False]


def test_aliased_tensors_are_restored_as_independent_tensors() -> None:
    t = torch.arange(6.0)
    state = {"a": t, "b": t, "view": t[2:4]}
    flat, out = roundtrip(state)
    assert len(flat.tensors) == 3
    out["a"].fill_(-1.0)
    assert torch.equal(out["b"], torch.arange(6.0))
    assert torch.equal(out["view"], torch.tensor([2.0, 3.0]))


def test_dtype_names_round_trip_and_unknown_names_are_refused() -> None:
    for name in DTYPE_NAMES:
        dtype = getattr(torch, name)
        assert dtype_name(dtype) == name
        assert dtype_from_name(name) is dtype
    assert dtype_name(torch.half) == "float16"
    assert dtype_name(torch.cfloat) == "complex64"
    for bad in ["float128", "torch.float32", "qint8", "", "Tensor"]:
        with pytest.raises(IntegrityError, match="unknown tensor dtype"):
            dtype_from_name(bad)
    with pytest.raises(IntegrityError):
        dtype_from_name(["float32"])  # type: ignore[arg-type]
    with pytest.raises(UnsupportedStateError, match="qint8"):
        dtype_name(torch.qint8)


# ---------------------------------------------------------------------------------------------
# plain leaves and containers


NAN_PAYLOAD = struct.unpack(">d", bytes.fromhex("7ff0000000000123"))[0]
NEG_NAN = struct.unpack(">d", bytes.fromhex("fff8000000000000"))[0]

PLAIN_LEAVES: list[Any] = [
    0, 1, -1, 2**53, -(2**53), 2**53 + 1, -(2**53) - 1, 2**63, 2**64 + 7, -(2**200), 10**5000,
    0.0, -0.0, 0.1, 1e-310, 5e-324, 1.7976931348623157e308, -2.5, 3.0,
    math.nan, NEG_NAN, NAN_PAYLOAD, math.inf, -math.inf,
    True, False, None,
    "", "t", "list", "pickle", "héllo \U0001f600 \x00 \n \"quoted\"",
    b"", b"\x00\xff\x10", bytes(range(256)),
    complex(1, 2), complex(-0.0, math.nan), complex(math.inf, -math.inf), 0j,
    torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.qint8, torch.int64,
    torch.device("cpu"), torch.device("cuda", 1), torch.device("meta"),
    torch.Size([]), torch.Size([2, 3]), torch.Size([0]),
]


@pytest.mark.parametrize("codec", sorted(JSON_CODECS))
def test_plain_leaves_roundtrip_type_and_bit_exact(codec: str) -> None:
    state = {f"k{i}": v for i, v in enumerate(PLAIN_LEAVES)}
    flat, out = roundtrip(state, codec=codec)
    assert_same(state, out)
    assert flat.tensors == [] and flat.metas == [] and flat.pickled is False
    # the leaves also round-trip as a bare root and inside a tuple
    assert_same(PLAIN_LEAVES, roundtrip(PLAIN_LEAVES, codec=codec)[1])
    assert_same(tuple(PLAIN_LEAVES), roundtrip(tuple(PLAIN_LEAVES), codec=codec)[1])


def test_tree_is_strict_json() -> None:
    state = {"nan": math.nan, "inf": [math.inf], "c": complex(math.nan, 1), "big": 2**70}
    text = json.dumps(flatten(state).tree, allow_nan=False)
    assert "NaN" not in text and "Infinity" not in text
    assert_same(state, unflatten(json.loads(text), []))


@pytest.mark.parametrize("leaf", [7, "x", None, 1.5, torch.zeros(2, 2), (1, 2), [3]])
def test_bare_root_values_roundtrip(leaf: Any) -> None:
    flat, out = roundtrip(leaf)
    assert_same(leaf, out)
    if isinstance(leaf, torch.Tensor):
        assert flat.metas == [TensorMeta(path="", dtype="float32", shape=(2, 2), nbytes=16)]


def test_containers_keep_their_exact_types_and_key_types() -> None:
    t = torch.arange(3, dtype=torch.int64)
    inner = OrderedDict([("w", t), ("b", (1, [2, (3,)]))])
    state = {
        "tuple": (1, (2, 3), [4, (5,)], ()),
        "list": [[], [[]], ()],
        "int_keys": {0: "a", 1: "b", -5: "c", 2**70: "d"},
        "mixed_keys": {1: "int", "1": "str", 1.5: "float", None: "none"},
        "bool_keys": {False: 0, True: 1, 2: 2},
        "float_keys": {-0.0: "negzero", math.inf: "inf", NAN_PAYLOAD: "nan"},
        "odict": inner,
        "odict_int_keys": OrderedDict([(3, "x"), (1, "y")]),
        "empty": ({}, OrderedDict(), []),
        "order": {"z": 1, "a": 2, "m": 3},
    }
    flat, out = roundtrip(state)
    assert_same(state, out)
    assert [m.path for m in flat.metas] == ["odict/w"]
    assert [type(k) for k in out["mixed_keys"]] == [int, str, float, type(None)]
    assert [type(k) for k in out["bool_keys"]] == [bool, bool, int]


def test_ordered_dict_metadata_roundtrips_and_is_absent_when_absent() -> None:
    with_meta: OrderedDict[str, Any] = OrderedDict(w=torch.ones(2))
    with_meta._metadata = OrderedDict([("", {"version": 1}), ("layer", {"version": 2})])  # type: ignore[attr-defined]
    none_meta: OrderedDict[str, Any] = OrderedDict(a=1)
    none_meta._metadata = None  # type: ignore[attr-defined]
    unstorable: OrderedDict[str, Any] = OrderedDict(a=1)
    unstorable._metadata = {"obj": object()}  # type: ignore[attr-defined]
    with_tensor: OrderedDict[str, Any] = OrderedDict(a=1)
    with_tensor._metadata = {"t": torch.zeros(1)}  # type: ignore[attr-defined]
    flat, out = roundtrip({"m": with_meta, "n": none_meta, "plain": OrderedDict(x=1), "u": unstorable,
                           "wt": with_tensor})
    assert out["m"]._metadata == with_meta._metadata
    assert type(out["m"]._metadata) is OrderedDict
    assert out["n"]._metadata is None
    assert not hasattr(out["plain"], "_metadata")
    assert not hasattr(out["u"], "_metadata")  # not plain data: dropped, not pickled
    assert not hasattr(out["wt"], "_metadata")
    assert len(flat.tensors) == 1 and flat.pickled is False


def mlp_with_optimizer(opt_cls: type[torch.optim.Optimizer], **kw: Any) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 2))
    opt = opt_cls(model.parameters(), **kw)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 5)).square().sum().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize(
    ("opt_cls", "kw"),
    [
        (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.8, 0.95)}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ],
)
def test_real_training_state_roundtrips_and_loads(opt_cls: type[torch.optim.Optimizer], kw: Any) -> None:
    model, opt = mlp_with_optimizer(opt_cls, **kw)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3, "rng": torch.get_rng_state()}
    flat, out = roundtrip(state)
    assert_same(state, out)
    assert type(out["optim"]["param_groups"][0]["params"]) is list
    if opt_cls is torch.optim.AdamW:
        assert out["optim"]["param_groups"][0]["betas"] == (0.8, 0.95)
        assert "optim/state/0/exp_avg" in [m.path for m in flat.metas]
    else:
        assert "optim/state/0/momentum_buffer" in [m.path for m in flat.metas]
    assert flat.metas[0] == TensorMeta(path="model/0.weight", dtype="float32", shape=(7, 5), nbytes=140)
    model2, opt2 = mlp_with_optimizer(opt_cls, **kw)
    model2.load_state_dict(out["model"])
    opt2.load_state_dict(out["optim"])
    assert_same(opt.state_dict(), opt2.state_dict())


# ---------------------------------------------------------------------------------------------
# unambiguous tags


TAG_LOOKALIKES: list[Any] = [
    {"t": 0},
    ["t", 0],
    ("t", 0),
    {"dict": {"a": 1}},
    ["dict", {"a": 1}],
    ["pickle", base64.b64encode(pickle.dumps(1)).decode()],
    ["int", "0x5"],
    ("float", "7ff8000000000000"),
    ["bytes", "AA=="],
    ["complex", 1.0, 2.0],
    ["dtype", "float32"],
    ["device", "cpu"],
    ["size", [1]],
    ["kdict", [[1, 2]]],
    ["odict", {}, None],
    {"__tensor__": 0, "__type__": "tuple"},
    [[]],
    {"": ""},
    "t",
]


@pytest.mark.parametrize("value", TAG_LOOKALIKES, ids=lambda v: json.dumps(v)[:40])
def test_user_data_that_looks_like_a_tag_roundtrips_as_itself(value: Any) -> None:
    flat, out = roundtrip({"v": value, "w": [value]})
    assert_same({"v": value, "w": [value]}, out)
    assert flat.tensors == [] and flat.pickled is False


# ---------------------------------------------------------------------------------------------
# refusals


class _Sub(torch.Tensor):
    pass


class _Point(NamedTuple):
    x: int
    y: int


@dataclasses.dataclass
class _Config:
    lr: float


class _Color(enum.IntEnum):
    RED = 1


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8)


UNSUPPORTED_LEAVES: dict[str, tuple[Callable[[], Any], str]] = {
    "sparse_coo": (lambda: torch.eye(3).to_sparse(), "to_dense"),
    "sparse_csr": (lambda: torch.eye(3).to_sparse_csr(), "to_dense"),
    "quantized": (_quantized, "dequantize"),
    "nested": (lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]), "unbind"),
    "meta": (lambda: torch.zeros(2, device="meta"), "materialize"),
    "subclass": (lambda: torch.zeros(2).as_subclass(_Sub), "as_subclass"),
    "uint4_dtype": (lambda: torch.empty(2, dtype=torch.uint4), "dtype"),
    "float4_dtype": (lambda: torch.empty(2, dtype=torch.float4_e2m1fn_x2), "dtype"),
    "object": (object, "not supported"),
    "set": (lambda: {1, 2}, "not supported"),
    "bytearray": (lambda: bytearray(b"ab"), "not supported"),
    "numpy_array": (lambda: np.zeros(3), "not supported"),
    "numpy_float": (lambda: np.float64(1.5), "float(x)"),
    "int_enum": (lambda: _Color.RED, "int(x)"),
    "defaultdict": (lambda: collections.defaultdict(int), "dict(x)"),
    "str_subclass": (lambda: type("S", (str,), {})("x"), "str(x)"),
    "namedtuple": (lambda: _Point(1, 2), "_asdict"),
    "dataclass": (lambda: _Config(0.1), "asdict"),
    "module": (lambda: torch.nn.Linear(2, 2), "state_dict()"),
    "function": (lambda: len, "not supported"),
}


@pytest.mark.parametrize("kind", sorted(UNSUPPORTED_LEAVES))
def test_unsupported_leaf_is_refused_with_its_key_path(kind: str) -> None:
    make, hint = UNSUPPORTED_LEAVES[kind]
    state = {"model": {"layer": [torch.zeros(1), make()]}, "epoch": 1}
    with pytest.raises(UnsupportedStateError) as info:
        flatten(state)
    message = str(info.value)
    assert "'model/layer/1'" in message
    assert hint in message


def test_dtensor_is_refused_with_its_key_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dtensor = distribute_tensor(torch.zeros(4), init_device_mesh("cpu", (1,)), [Replicate()])
        with pytest.raises(UnsupportedStateError, match=r"'w/0'.*DTensor.*full_tensor"):
            flatten({"w": [dtensor]})
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "key", [(1, 2), frozenset({1}), torch.device("cpu"), b"raw", 1j], ids=lambda k: type(k).__name__
)
def test_dict_keys_that_are_not_json_scalars_are_refused(key: Any) -> None:
    with pytest.raises(UnsupportedStateError) as info:
        flatten({"optim": {"state": {key: 1}}})
    assert "'optim/state'" in str(info.value)
    assert repr(key) in str(info.value)


def test_tensor_dict_key_is_refused() -> None:
    with pytest.raises(UnsupportedStateError, match=r"'a'.*key"):
        flatten({"a": {torch.zeros(1): 1}})


def _self_list() -> Any:
    x: list[Any] = [1]
    x.append(x)
    return {"a": x}


def _self_dict() -> Any:
    d: dict[str, Any] = {}
    d["me"] = {"again": d}
    return {"a": d}


def _through_tuple() -> Any:
    x: list[Any] = []
    x.append((x,))
    return {"a": x}


@pytest.mark.parametrize(("make", "path"), [(_self_list, "'a/1'"), (_self_dict, "'a/me/again'"),
                                             (_through_tuple, "'a/0/0'")])
@pytest.mark.parametrize("allow_pickle", [False, True])
def test_reference_cycles_are_refused(make: Callable[[], Any], path: str, allow_pickle: bool) -> None:
    with pytest.raises(UnsupportedStateError, match="cycle") as info:
        flatten(make(), allow_pickle=allow_pickle)
    assert path in str(info.value)


def test_shared_container_that_is_not_a_cycle_is_stored_twice() -> None:
    shared = [1, {"x": 2.5}]
    out = roundtrip({"a": shared, "b": shared, "c": (shared, shared)})[1]
    assert_same({"a": shared, "b": shared, "c": (shared, shared)}, out)
    assert out["a"] is not out["b"]


def test_nesting_deeper_than_the_recursion_limit_is_refused() -> None:
    state: Any = 1
    for _ in range(5000):
        state = [state]
    with pytest.raises(UnsupportedStateError, match="nested too deeply"):
        flatten(state)


# ---------------------------------------------------------------------------------------------
# pickle opt-in


@pytest.mark.parametrize("kind", ["object_free", "set", "numpy_array", "namedtuple", "dataclass", "int_enum",
                                  "defaultdict", "sparse_coo", "tuple_key"])
def test_allow_pickle_roundtrips_arbitrary_objects(kind: str) -> None:
    values: dict[str, Any] = {
        "object_free": collections.Counter("abca"),
        "set": {1, 2, 3},
        "numpy_array": np.arange(4.0),
        "namedtuple": _Point(1, 2),
        "dataclass": _Config(0.5),
        "int_enum": _Color.RED,
        "defaultdict": collections.defaultdict(int, a=1),
        "sparse_coo": torch.eye(3).to_sparse(),
        "tuple_key": {(1, "a"): 2},
    }
    value = values[kind]
    state = {"x": [value], "w": torch.ones(2), "n": 3}
    flat, out = roundtrip(state, allow_pickle=True)
    assert flat.pickled is True
    assert len(flat.tensors) == 1 and torch.equal(out["w"], torch.ones(2))
    restored = out["x"][0]
    assert type(restored) is type(value)
    if kind == "sparse_coo":
        assert torch.equal(restored.to_dense(), torch.eye(3))
    elif kind == "numpy_array":
        assert restored.tolist() == [0.0, 1.0, 2.0, 3.0]
    else:
        assert restored == value
    # restoring the same tree without the opt-in is refused, naming the config switch
    with pytest.raises(UnsupportedStateError, match=r"allow_pickle = true"):
        unflatten(json.loads(json.dumps(flat.tree)), [stored(t) for t in flat.tensors])


def test_allow_pickle_pickles_only_what_needs_it() -> None:
    flat = flatten({"a": [1, "x", torch.zeros(1)], "b": {0: 1.5}}, allow_pickle=True)
    assert flat.pickled is False
    assert "pickle" not in json.dumps(flat.tree)


def test_unpicklable_value_is_refused_even_with_allow_pickle() -> None:
    with pytest.raises(UnsupportedStateError, match=r"'a/0'.*pickle"):
        flatten({"a": [lambda: 1]}, allow_pickle=True)


# ---------------------------------------------------------------------------------------------
# malformed trees


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


MALFORMED: list[tuple[Any, int]] = [
    (["nope", 1], 0),
    ([], 0),
    ({"a": 1}, 0),
    ([["t"], 0], 0),
    (["t", 1], 1),
    (["t", 0], 0),
    (["t", True], 1),
    (["t", "0"], 1),
    (["t", -1], 1),
    (["list", ["t", 1], ["t", 0]], 2),
    (["t", 0], 2),
    (["list", ["t", 0], ["t", 0]], 2),
    (["dict", [1]], 0),
    (["dict", {"a": 1}, "extra"], 0),
    (["odict", {"a": 1}, None, "extra"], 0),
    (["kdict", {"a": 1}], 0),
    (["kdict", [[1]]], 0),
    (["kdict", [5]], 0),
    (["kdict", [[["list"], 1]]], 0),
    (["kdict", [[["t", 0], 1]]], 1),
    (["int", "zz"], 0),
    (["int", 5], 0),
    (["float", "00"], 0),
    (["float", 1.5, 2.5], 0),
    (["bytes", "!!"], 0),
    (["bytes"], 0),
    (["complex", 1], 0),
    (["complex", "a", "b"], 0),
    (["dtype", "nope"], 0),
    (["dtype", "Tensor"], 0),
    (["dtype", 3], 0),
    (["device", "nope:x"], 0),
    (["size", [-1]], 0),
    (["size", [1.5]], 0),
    (["pickle", 5], 0),
    (["pickle", "!!"], 0),
    (["pickle", _b64(b"not a pickle")], 0),
    (["list", 1j], 0),
]


@pytest.mark.parametrize(("tree", "n_tensors"), MALFORMED, ids=lambda v: repr(v)[:40])
def test_malformed_tree_raises_integrity_error(tree: Any, n_tensors: int) -> None:
    with pytest.raises(IntegrityError):
        unflatten(tree, [torch.zeros(1) for _ in range(n_tensors)], allow_pickle=True)


def test_too_deep_tree_raises_integrity_error() -> None:
    tree: Any = 1
    for _ in range(5000):
        tree = ["list", tree]
    with pytest.raises(IntegrityError, match="too deeply"):
        unflatten(tree, [])


def test_tensors_are_placed_as_given_without_copy() -> None:
    flat = flatten({"a": torch.zeros(2), "b": [torch.ones(3)]})
    given_tensors = [torch.full((2,), 5.0), torch.full((3,), 7.0)]
    out = unflatten(flat.tree, given_tensors)
    assert out["a"] is given_tensors[0]
    assert out["b"][0] is given_tensors[1]


# ---------------------------------------------------------------------------------------------
# structure key


def _state(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": OrderedDict([("w", torch.zeros(2, 3)), ("b", torch.zeros(3))]),
        "optim": {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "epoch": 3,
    }
    base.update(over)
    return base


def test_structure_key_ignores_leaf_and_tensor_values() -> None:
    a = flatten(_state())
    b = flatten(_state(epoch=4, optim={"state": {0: {"step": torch.tensor(9.0)}},
                                       "param_groups": [{"lr": 0.5, "params": [7]}]}))
    c = flatten(_state(epoch="four", model=OrderedDict([("w", torch.ones(2, 3)), ("b", torch.ones(3))])))
    assert a.structure_key == b.structure_key == c.structure_key
    assert hash(a.structure_key) == hash(b.structure_key)
    assert {a.structure_key: 1}[c.structure_key] == 1
    assert a.metas == b.metas == c.metas
    # metas of an unchanged structure are reused, not rebuilt (model state dicts included)
    assert all(x is y for x, y in zip(a.metas, c.metas, strict=True))
    model = torch.nn.Linear(3, 2)
    first, second = flatten({"model": model.state_dict()}), flatten({"model": model.state_dict()})
    assert all(x is y for x, y in zip(first.metas, second.metas, strict=True))


STRUCTURE_CHANGES: dict[str, dict[str, Any]] = {
    "shape": {"model": OrderedDict([("w", torch.zeros(3, 2)), ("b", torch.zeros(3))])},
    "dtype": {"model": OrderedDict([("w", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(3))])},
    "renamed_key": {"model": OrderedDict([("w2", torch.zeros(2, 3)), ("b", torch.zeros(3))])},
    "key_order": {"model": OrderedDict([("b", torch.zeros(3)), ("w", torch.zeros(2, 3))])},
    "extra_key": {"extra": None},
    "odict_to_dict": {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}},
    "int_key_to_str": {"optim": {"state": {"0": {"step": torch.tensor(1.0)}},
                                 "param_groups": [{"lr": 0.1, "params": [0]}]}},
    "int_key_to_bool": {"optim": {"state": {True: {"step": torch.tensor(1.0)}},
                                  "param_groups": [{"lr": 0.1, "params": [0]}]}},
    "list_to_tuple": {"optim": {"state": {0: {"step": torch.tensor(1.0)}},
                                "param_groups": ({"lr": 0.1, "params": [0]},)}},
    "leaf_to_tensor": {"epoch": torch.tensor(3)},
    "leaf_to_container": {"epoch": [3]},
    "list_length": {"optim": {"state": {0: {"step": torch.tensor(1.0)}},
                              "param_groups": [{"lr": 0.1, "params": [0, 1]}]}},
}


@pytest.mark.parametrize("change", sorted(STRUCTURE_CHANGES))
def test_structure_key_changes_with_the_structure(change: str) -> None:
    before = flatten(_state())
    changed = _state(**STRUCTURE_CHANGES[change])
    after = flatten(changed)
    assert after.structure_key != before.structure_key
    # the metas are rebuilt for the new structure, then again for the old one
    assert after.metas == _reference_metas(changed)
    assert flatten(_state()).metas == before.metas


def test_structure_key_tells_tensor_position_among_leaves() -> None:
    t = torch.zeros(1)
    assert flatten([1, t]).structure_key != flatten([t, 1]).structure_key
    assert flatten([1, t]).metas[0].path == "1"
    assert flatten([t, 1]).metas[0].path == "0"


def _reference_metas(state: Any) -> list[TensorMeta]:
    """Metas computed independently of flatten, by a plain recursive walk."""
    out: list[TensorMeta] = []

    def walk(x: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            out.append(TensorMeta(path, dtype_name(x.dtype), tuple(x.shape), x.numel() * x.element_size()))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}/{k}" if path else str(k))
        elif isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
            for i, v in enumerate(x):
                walk(v, f"{path}/{i}" if path else str(i))

    walk(state, "")
    return out


# ---------------------------------------------------------------------------------------------
# generated states


_STORABLE_DTYPES = [getattr(torch, n) for n in DTYPE_NAMES]

tensors_st = st.builds(
    random_tensor,
    st.sampled_from(_STORABLE_DTYPES),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.integers(0, 2**16),
)
leaves_st = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.complex_numbers(allow_nan=True, allow_infinity=True),
    st.sampled_from([torch.float32, torch.int8, torch.bool, torch.device("cpu"), torch.Size([1, 2])]),
    tensors_st,
)
keys_st = st.one_of(st.text(max_size=6), st.integers(-3, 2**70), st.floats(), st.booleans(), st.none())


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=6), children, max_size=4),
        st.dictionaries(keys_st, children, max_size=4),
        st.dictionaries(st.text(max_size=6), children, max_size=4).map(OrderedDict),
        st.dictionaries(keys_st, children, max_size=4).map(OrderedDict),
    )


states_st = st.recursive(leaves_st, _containers, max_leaves=30)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=states_st, codec=st.sampled_from(sorted(JSON_CODECS)))
def test_generated_states_roundtrip_exactly(state: Any, codec: str) -> None:
    flat, out = roundtrip(state, codec=codec)
    assert_same(state, out)
    assert flat.pickled is False
    assert flat.metas == _reference_metas(state)
    again = flatten(out)
    assert again.structure_key == flat.structure_key
    assert again.metas == flat.metas
