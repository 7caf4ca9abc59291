"""State dict <-> (JSON object tree, flat list of tensors), with no pickle unless opted into.

:func:`flatten` walks a training state (nested dicts, lists and tuples of tensors and plain values)
once and returns a JSON-able *object tree*, the tensors in tree order, and one :class:`TensorMeta`
per tensor. :func:`unflatten` rebuilds the state from a tree and a list of tensors holding the same
bytes.

Tree encoding. Plain JSON scalars stand for themselves: ``str``, ``bool``, ``None``, finite
``float`` and ``int`` within +-2**53 (the range every JSON reader keeps exactly). Everything else
is a JSON array whose first element is a tag string::

    ["t", i]                        the i-th tensor (indices run 0, 1, 2, ... in tree order)
    ["list", v...]                  list
    ["tuple", v...]                 tuple
    ["dict", {k: v}]                dict whose keys are all str (JSON keeps their order)
    ["kdict", [[k, v]...]]          dict with other keys (int, float, bool, None); k is encoded
    ["odict", {k: v}, meta?]        OrderedDict (meta: its encoded ``_metadata``, when present)
    ["kodict", [[k, v]...], meta?]  OrderedDict with other keys
    ["int", "0x..."]                int outside +-2**53 (hex: no digit limit)
    ["float", "7ff8000000000000"]   nan/inf/-inf as their IEEE-754 bits (keeps NaN payloads)
    ["bytes", base64]   ["complex", re, im]   ["dtype", name]   ["device", str]   ["size", [n...]]
    ["pickle", base64]              pickled leaf (only with ``allow_pickle``)

Because a user's list or dict is itself always wrapped in a tagged array, no user value can be
mistaken for a tag: a user dict ``{"t": 0}`` is ``["dict", {"t": 0}]`` and a user list ``["t", 0]``
is ``["list", "t", 0]``.

Aliasing is not preserved: a tensor that appears twice in the state (the same object, or two views
of one storage) is stored twice and restored as independent tensors, and likewise a container that
appears twice is restored as two equal copies.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiercache.dtypes import DTYPES
from tiercache.errors import IntegrityError, UnsupportedStateError

_log = logging.getLogger("tiercache.format")

__all__ = ["Flat", "TensorMeta", "dtype_from_name", "dtype_name", "flatten", "tensor_paths", "unflatten"]

# Tensor dtypes whose bytes can be stored and restored as is (tiercache.dtypes); older torch
# builds lack some names.
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in DTYPES if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES: dict[torch.dtype, str] = {d: n for n, d in _DTYPES.items()}
_COMPLEX_NAMES = frozenset(n for n in _DTYPES if DTYPES[n].complex)

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_STRIDED = torch.strided

_JSON_SAFE_INT = 1 << 53
_PICKLE_HINT = (
    "or, only if every writer of this cache is trusted, opt into pickle with `allow_pickle = true` "
    "in the cache config"
)

_TENSOR = "t"
_LIST = "list"
_TUPLE = "tuple"
_DICT = "dict"
_KDICT = "kdict"
_ODICT = "odict"
_KODICT = "kodict"
_INT = "int"
_FLOAT = "float"
_BYTES = "bytes"
_COMPLEX = "complex"
_DTYPE = "dtype"
_DEVICE = "device"
_SIZE = "size"
_PICKLE = "pickle"

# Structure-key token of a plain leaf: its value may change without changing the structure.
_LEAF_TOKEN = None


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What the manifest records about one tensor of a state.

    Attributes:
        path: Human-readable key path, e.g. ``"optim/state/0/exp_avg"`` (for messages and ``ls``).
        dtype: Canonical dtype name, e.g. ``"float32"``, ``"bfloat16"`` (see :func:`dtype_name`).
        shape: The tensor's shape.
        nbytes: Bytes of the tensor's data (``numel * itemsize``), not of its storage.
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class Flat:
    """A state split into a JSON-able object tree and its tensors.

    Attributes:
        tree: The object tree; ``json.dumps(tree, allow_nan=False)`` works.
        tensors: The state's tensors in tree order. These are the caller's tensors (detached from
            autograd), not copies: they must be copied before training mutates them.
        metas: One :class:`TensorMeta` per tensor, in the same order.
        pickled: Whether some leaf was pickled (only possible with ``allow_pickle``).
        structure_key: Equal for two states with the same containers, keys and tensor
            dtypes/shapes in the same order, whatever their plain leaf values; a cache key for
            anything planned from the tensor table.
    """

    tree: Any
    tensors: list[torch.Tensor]
    metas: list[TensorMeta]
    pickled: bool
    structure_key: Hashable


def dtype_name(dtype: torch.dtype) -> str:
    """Return the canonical name of a storable tensor dtype (``torch.float32`` -> ``"float32"``).

    Raises:
        UnsupportedStateError: If tensors of this dtype cannot be stored (quantized, sub-byte).
    """
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedStateError(
            f"tensors of dtype {dtype} cannot be stored; convert them with .to(<a standard dtype>)"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """Return the tensor dtype a canonical name (from :func:`dtype_name`) stands for.

    Raises:
        IntegrityError: If ``name`` is not the name of a storable dtype.
    """
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise IntegrityError(f"unknown tensor dtype {name!r} in a manifest") from None


def flatten(state: Any, *, allow_pickle: bool = False, shards: bool = False) -> Flat:
    """Split a training state into a JSON-able object tree and its tensors, in one pass.

    Args:
        state: Nested dicts, OrderedDicts, lists and tuples of tensors and plain values, e.g.
            ``{"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}``.
        allow_pickle: Pickle leaves that cannot be stored otherwise instead of refusing them.
        shards: Store each DTensor as this rank's local shard (a rank's part of a multi-rank save).

    Returns:
        The tree, the tensors (not copied), their metadata, and the structure key.

    Raises:
        UnsupportedStateError: For a leaf that cannot be stored (without ``allow_pickle``), a
            dict key that is not str/int/float/bool/None, a reference cycle, or nesting deeper
            than Python's recursion limit; the message names the key path and what to do.
    """
    enc = _Encoder(allow_pickle, dtensor_class() if shards else None)
    try:
        tree = enc.encode(state, "")
    except RecursionError:
        raise UnsupportedStateError(
            "the state is nested too deeply to store; flatten its deepest containers"
        ) from None
    key = tuple(enc.skeleton)
    return Flat(
        tree=tree,
        tensors=enc.tensors,
        metas=_metas(key, enc.paths),
        pickled=enc.pickled,
        structure_key=key,
    )


def tensor_paths(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of a state by the key path :func:`flatten` gives them, and nothing else.

    What a ``restore(into=...)`` needs of its state: plain values are skipped and nothing is
    encoded, so a state of 100k tensors costs one dict entry per tensor, not a tree and a
    :class:`TensorMeta` each. Only plain tensors and parameters are collected (tensor subclasses,
    DTensors and other leaves are skipped, as :func:`flatten` with ``allow_pickle`` would not
    store them as tensors); the caller checks dtype, layout and device.

    Raises:
        UnsupportedStateError: For a reference cycle or nesting deeper than Python's recursion limit.
    """
    out: dict[str, torch.Tensor] = {}
    active: set[int] = set()

    def walk(x: Any, prefix: str, path: str) -> None:
        tp = type(x)
        if tp is dict or tp is OrderedDict:
            items: Any = x.items()
        elif tp is list or tp is tuple:
            items = enumerate(x)
        else:
            return
        key = id(x)
        if key in active:
            raise UnsupportedStateError(
                f"the state contains a reference cycle at {_shown(path)}: a container holds itself; "
                "break the cycle before restoring into it"
            )
        active.add(key)
        for k, v in items:
            tv = type(v)
            if tv is _Tensor or tv is _Parameter:
                out[prefix + k if type(k) is str else f"{prefix}{k}"] = v
            elif tv is dict or tv is list or tv is OrderedDict or tv is tuple:
                sub = prefix + k if type(k) is str else f"{prefix}{k}"
                walk(v, sub + "/", sub)
        active.discard(key)

    try:
        if type(state) is _Tensor or type(state) is _Parameter:
            return {"": state}
        walk(state, "", "")
    except RecursionError:
        raise UnsupportedStateError("the state is nested too deeply; flatten its deepest containers") from None
    return out


def dtensor_class() -> type | None:
    """The DTensor class of torch (``None`` in a build without distributed tensors)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed tensors holds none
        return None
    return DTensor


# The last structure key and its metas: saves of one training run share a structure, and building
# thousands of TensorMeta objects per save would cost more than the rest of flatten.
_last_metas: tuple[tuple[Hashable, ...], tuple[TensorMeta, ...]] | None = None


def _metas(key: tuple[Hashable, ...], paths: list[str]) -> list[TensorMeta]:
    global _last_metas
    last = _last_metas  # one read: another thread may replace it meanwhile
    if last is not None and last[0] == key:
        # Equal keys mean equal keys of every container, hence equal paths, dtypes and shapes.
        return list(last[1])
    # Tuples in the key are exactly the tensors' (dtype name, torch.Size), in tensor order.
    layouts = [token for token in key if type(token) is tuple]
    metas = tuple(
        TensorMeta(path, name, tuple(shape), math.prod(shape) * _DTYPES[name].itemsize)
        for path, (name, shape) in zip(paths, layouts, strict=True)
    )
    _last_metas = (key, metas)
    return list(metas)


def unflatten(tree: Any, tensors: Sequence[torch.Tensor], *, allow_pickle: bool = False) -> Any:
    """Rebuild a state from an object tree made by :func:`flatten` and its tensors.

    Args:
        tree: The object tree, as returned by :func:`flatten` or after a JSON round trip.
        tensors: Tensors holding the saved bytes, in tree order; they are placed in the state
            as given (not copied).
        allow_pickle: Unpickle pickled leaves; without it a pickled leaf is refused.

    Returns:
        The state, with the container and leaf types it was saved with.

    Raises:
        IntegrityError: If the tree is malformed (unknown tag, wrong types, a tensor index out
            of order or range, or a tensor count that differs from ``len(tensors)``).
        UnsupportedStateError: If the tree holds a pickled leaf and ``allow_pickle`` is false.
    """
    dec = _Decoder(tensors, allow_pickle)
    try:
        state = dec.decode(tree)
    except RecursionError:
        raise IntegrityError("the object tree is nested too deeply") from None
    if dec.next_index != len(tensors):
        raise IntegrityError(f"the object tree names {dec.next_index} tensors but {len(tensors)} were given")
    return state


def _shown(path: str) -> str:
    return repr(path) if path else "the state's root"


def _encode_float(x: float) -> float | list[str]:
    if math.isfinite(x):
        return x
    return [_FLOAT, struct.pack(">d", x).hex()]


def _decode_float(node: Any) -> float:
    if type(node) is float:
        return node
    if type(node) is int:
        return float(node)
    if type(node) is list and len(node) == 2 and node[0] == _FLOAT and type(node[1]) is str:
        try:
            return struct.unpack(">d", bytes.fromhex(node[1]))[0]
        except (ValueError, struct.error):
            pass
    raise IntegrityError(f"malformed float {node!r} in the object tree")


class _Encoder:
    """One :func:`flatten` pass: the tree is returned, tensors and tokens accumulate here."""

    __slots__ = ("_active", "allow_pickle", "paths", "pickled", "shards", "skeleton", "tensors")

    def __init__(self, allow_pickle: bool, shards: type | None = None) -> None:
        self.allow_pickle = allow_pickle
        #: The DTensor class, when DTensors are saved as their local shards.
        self.shards = shards
        self.tensors: list[torch.Tensor] = []
        self.paths: list[str] = []
        # Prefix-free token stream of the structure: a tag and length per container, keys in
        # order, a (dtype name, torch.Size) tuple per tensor and a leaf token per plain value.
        self.skeleton: list[Hashable] = []
        self.pickled = False
        # ids of the containers on the current path, to refuse cycles instead of recursing forever
        self._active: set[int] = set()

    def encode(self, x: Any, path: str) -> Any:
        tp = type(x)
        if tp is _Tensor or tp is _Parameter:
            return self._tensor(x, path)
        if tp is str or tp is bool or x is None:
            self.skeleton.append(_LEAF_TOKEN)
            return x
        if tp is dict:
            return self._dict(x, path, _DICT, _KDICT)
        if tp is list or tp is tuple:
            return self._sequence(x, path, _LIST if tp is list else _TUPLE)
        if tp is OrderedDict:
            return self._dict(x, path, _ODICT, _KODICT)
        leaf = _encode_scalar(x)
        if leaf is not _NO_ENCODING:
            self.skeleton.append(_LEAF_TOKEN)
            return leaf
        if self.shards is not None and isinstance(x, self.shards):
            return self._tensor(x.to_local(), path)  # a view of this rank's shard: no copy
        return self._other(x, path)

    def _tensor(self, t: torch.Tensor, path: str) -> Any:
        if t.requires_grad or type(t) is _Parameter:
            t = t.detach()
        name = _DTYPE_NAMES.get(t.dtype)
        if name is None or t.layout is not _STRIDED or t.is_nested or t.is_meta:
            return self._other(t, path)
        if t.is_neg() or (name in _COMPLEX_NAMES and t.is_conj()):
            # A lazy conj/neg bit is not in the bytes; materialize it (a copy, only in this rare case).
            t = t.resolve_conj().resolve_neg()
        self.skeleton.append((name, t.shape))
        self.paths.append(path)
        self.tensors.append(t)
        return [_TENSOR, len(self.tensors) - 1]

    def _enter(self, x: Any, path: str) -> int:
        key = id(x)
        if key in self._active:
            raise UnsupportedStateError(
                f"the state contains a reference cycle at {_shown(path)}: a container holds itself; "
                "break the cycle before saving"
            )
        self._active.add(key)
        return key

    def _sequence(self, seq: list[Any] | tuple[Any, ...], path: str, tag: str) -> list[Any]:
        key = self._enter(seq, path)
        self.skeleton.append(tag)
        self.skeleton.append(len(seq))
        prefix = f"{path}/" if path else ""
        encode = self.encode
        node: list[Any] = [tag]
        node.extend(encode(v, f"{prefix}{i}") for i, v in enumerate(seq))
        self._active.discard(key)
        return node

    def _dict(self, d: dict[Any, Any], path: str, str_tag: str, key_tag: str) -> list[Any]:
        ident = self._enter(d, path)
        prefix = f"{path}/" if path else ""
        encode = self.encode
        skeleton = self.skeleton
        node: list[Any]
        if set(map(type, d)) <= {str}:
            skeleton.append(str_tag)
            skeleton.append(len(d))
            tensor = self._tensor
            obj: dict[str, Any] = {}
            for k, v in d.items():
                skeleton.append(k)
                # Tensors inline: most values of a state dict are tensors, and a call costs.
                tv = type(v)
                obj[k] = tensor(v, prefix + k) if tv is _Tensor or tv is _Parameter else encode(v, prefix + k)
            node = [str_tag, obj]
        else:
            skeleton.append(key_tag)
            skeleton.append(len(d))
            pairs: list[list[Any]] = []
            for k, v in d.items():
                # repr tells 1, True, 1.0 and "1" apart, which equality would not
                skeleton.append(repr(k))
                pairs.append([self._key(k, path), encode(v, f"{prefix}{k}")])
            node = [key_tag, pairs]
        if str_tag == _ODICT:
            meta = self._ordered_metadata(d, path)
            if meta is not _NO_ENCODING:
                node.append(meta)
        self._active.discard(ident)
        return node

    def _key(self, k: Any, dict_path: str) -> Any:
        tp = type(k)
        if tp is str or tp is bool or k is None:
            return k
        if tp is int or tp is float:
            return _encode_scalar(k)
        if self.allow_pickle:
            return self._pickle(k, dict_path)
        raise UnsupportedStateError(
            f"the dict at {_shown(dict_path)} has a key {k!r} of type "
            f"{_type_name(k)}; only str, int, float, bool and None keys can be stored without pickle: "
            f"convert the key to a str, {_PICKLE_HINT}"
        )

    def _ordered_metadata(self, d: dict[Any, Any], path: str) -> Any:
        """Encode a state dict's ``_metadata`` (load_state_dict reads it), if it is plain data."""
        meta = getattr(d, "_metadata", _NO_ENCODING)
        if meta is _NO_ENCODING:
            return _NO_ENCODING
        # A separate encoder: its tokens stay out of this state's structure key, and flatten()
        # is not called so that the metas cache keeps the state's structure.
        sub = _Encoder(allow_pickle=False)
        try:
            tree = sub.encode(meta, path)
        except (UnsupportedStateError, RecursionError):
            tree = _NO_ENCODING
        if tree is _NO_ENCODING or sub.tensors:
            _log.debug("dropping the _metadata of %s: it is not plain data", _shown(path))
            return _NO_ENCODING
        return tree

    def _other(self, x: Any, path: str) -> Any:
        if self.allow_pickle:
            self.skeleton.append(_LEAF_TOKEN)
            return self._pickle(x, path)
        raise UnsupportedStateError(f"cannot store the value at {_shown(path)}: {_refusal(x)}")

    def _pickle(self, x: Any, path: str) -> list[str]:
        try:
            data = pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise UnsupportedStateError(
                f"cannot pickle the value at {_shown(path)} ({_type_name(x)}): {e}"
            ) from e
        self.pickled = True
        return [_PICKLE, base64.b64encode(data).decode("ascii")]


class _NoEncoding:
    """Sentinel type: the value has no encoding of this kind (or is absent)."""


_NO_ENCODING: Any = _NoEncoding()


def _encode_scalar(x: Any) -> Any:
    """Encode an int, float, bytes, complex, dtype, device or Size leaf; else ``_NO_ENCODING``."""
    tp = type(x)
    if tp is int:
        return x if -_JSON_SAFE_INT <= x <= _JSON_SAFE_INT else [_INT, hex(x)]
    if tp is float:
        return _encode_float(x)
    if tp is bytes:
        return [_BYTES, base64.b64encode(x).decode("ascii")]
    if tp is complex:
        return [_COMPLEX, _encode_float(x.real), _encode_float(x.imag)]
    if tp is torch.dtype:
        return [_DTYPE, str(x).removeprefix("torch.")]
    if tp is torch.device:
        return [_DEVICE, str(x)]
    if tp is torch.Size:
        return [_SIZE, list(x)]
    return _NO_ENCODING


def _type_name(x: Any) -> str:
    tp = type(x)
    return tp.__qualname__ if tp.__module__ == "builtins" else f"{tp.__module__}.{tp.__qualname__}"


def _refusal(x: Any) -> str:
    """Say why ``x`` cannot be stored without pickle and what to do instead."""
    what = _type_name(x)
    if isinstance(x, torch.Tensor):
        if type(x).__name__ == "DTensor":
            return (
                "DTensor is not supported yet; save `t.full_tensor()` (or each rank's "
                "`t.to_local()`), or use torch.distributed.checkpoint"
            )
        if type(x) not in (torch.Tensor, torch.nn.Parameter):
            return (
                f"tensor subclass {what} is not supported; store `t.as_subclass(torch.Tensor)` "
                f"and rebuild the subclass after restore, {_PICKLE_HINT}"
            )
        if x.is_quantized:
            return (
                f"quantized tensors are not supported; store `t.dequantize()` or `t.int_repr()`, "
                f"{_PICKLE_HINT}"
            )
        if x.layout is not torch.strided:
            return f"{x.layout} tensors are not supported; store `t.to_dense()`, {_PICKLE_HINT}"
        if x.is_nested:
            return f"nested tensors are not supported; store `list(t.unbind())`, {_PICKLE_HINT}"
        if x.is_meta:
            return (
                "meta tensors hold no data; materialize the tensor first (e.g. "
                "`module.to_empty(device='cpu')`) or drop it from the state"
            )
        return f"tensors of dtype {x.dtype} are not supported; convert with `t.to(<a standard dtype>)`"
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return f"namedtuple {what} is not supported; store `x._asdict()` or `tuple(x)`, {_PICKLE_HINT}"
    if hasattr(type(x), "__dataclass_fields__"):
        return f"dataclass {what} is not supported; store `dataclasses.asdict(x)`, {_PICKLE_HINT}"
    base = next((b for b in (int, float, str, bytes, dict, list, tuple) if isinstance(x, b)), None)
    if base is not None:
        return (
            f"{what} is a subclass of {base.__name__}, which is not supported; convert it with "
            f"`{base.__name__}(x)`, {_PICKLE_HINT}"
        )
    if hasattr(x, "state_dict"):
        return f"{what} is not supported; store `x.state_dict()` instead, {_PICKLE_HINT}"
    return (
        f"{what} is not supported; store tensors and plain values (dict, list, tuple, str, int, "
        f"float, bool, None, bytes, complex, torch.dtype/device/Size), {_PICKLE_HINT}"
    )


class _Decoder:
    """One :func:`unflatten` pass over a tree; checks every node it reads."""

    __slots__ = ("allow_pickle", "next_index", "tensors")

    def __init__(self, tensors: Sequence[torch.Tensor], allow_pickle: bool) -> None:
        self.tensors = tensors
        self.allow_pickle = allow_pickle
        self.next_index = 0

    def decode(self, node: Any) -> Any:
        tp = type(node)
        if tp is list:
            tag = node[0] if node else None
            if tag == _TENSOR and len(node) == 2:
                return self._tensor(node[1])
            handler = _DECODERS.get(tag) if type(tag) is str else None
            if handler is None:
                raise IntegrityError(f"unknown tag {tag!r} in the object tree")
            return handler(self, node)
        if tp is str or tp is int or tp is float or tp is bool or node is None:
            return node
        raise IntegrityError(f"unexpected {tp.__name__} in the object tree")

    def _tensor(self, index: Any) -> torch.Tensor:
        if type(index) is not int or index != self.next_index:
            raise IntegrityError(f"tensor index {index!r} in the object tree; expected {self.next_index}")
        if index >= len(self.tensors):
            raise IntegrityError(f"tensor index {index} is out of range: {len(self.tensors)} tensors given")
        self.next_index += 1
        return self.tensors[index]

    def list_(self, node: list[Any]) -> list[Any]:
        decode = self.decode
        return [decode(v) for v in node[1:]]

    def tuple_(self, node: list[Any]) -> tuple[Any, ...]:
        decode = self.decode
        return tuple(decode(v) for v in node[1:])

    def dict_(self, node: list[Any]) -> dict[Any, Any]:
        return self._str_keyed(node, {}, 2)

    def kdict(self, node: list[Any]) -> dict[Any, Any]:
        return self._pairs(node, {}, 2)

    def odict(self, node: list[Any]) -> OrderedDict[Any, Any]:
        return self._with_metadata(node, self._str_keyed(node, OrderedDict(), 3))

    def kodict(self, node: list[Any]) -> OrderedDict[Any, Any]:
        return self._with_metadata(node, self._pairs(node, OrderedDict(), 3))

    def _str_keyed(self, node: list[Any], out: dict[Any, Any], max_len: int) -> dict[Any, Any]:
        if not 2 <= len(node) <= max_len or type(node[1]) is not dict:
            raise IntegrityError(f"malformed {node[0]} node in the object tree")
        decode = self.decode
        tensors, count = self.tensors, len(self.tensors)
        nxt = self.next_index
        # Tensor references inline: a state dict's values are mostly tensors, and a call per
        # value cost most of rebuilding a state of 100k tensors.
        for k, v in node[1].items():
            if (type(v) is list and len(v) == 2 and v[0] == _TENSOR and v[1] == nxt and type(v[1]) is int
                    and nxt < count):
                out[k] = tensors[nxt]
                nxt += 1
                continue
            self.next_index = nxt
            out[k] = decode(v)  # anything else, and a bad tensor reference (its own message)
            nxt = self.next_index
        self.next_index = nxt
        return out

    def _pairs(self, node: list[Any], out: dict[Any, Any], max_len: int) -> dict[Any, Any]:
        if not 2 <= len(node) <= max_len or type(node[1]) is not list:
            raise IntegrityError(f"malformed {node[0]} node in the object tree")
        decode = self.decode
        for pair in node[1]:
            if type(pair) is not list or len(pair) != 2:
                raise IntegrityError(f"malformed key/value pair {pair!r} in the object tree")
            out[self._key(pair[0])] = decode(pair[1])
        return out

    def _key(self, node: Any) -> Any:
        key = self.decode(node)
        try:
            hash(key)
        except TypeError:
            raise IntegrityError(f"unhashable dict key {node!r} in the object tree") from None
        if isinstance(key, torch.Tensor):
            raise IntegrityError("a tensor used as a dict key in the object tree")
        return key

    def _with_metadata(self, node: list[Any], out: OrderedDict[Any, Any]) -> OrderedDict[Any, Any]:
        if len(node) == 3:
            # Decoded on its own: flatten encoded it as a separate tree, with no tensors.
            out._metadata = unflatten(node[2], (), allow_pickle=False)  # type: ignore[attr-defined]
        return out

    def int_(self, node: list[Any]) -> int:
        if len(node) == 2 and type(node[1]) is str:
            try:
                return int(node[1], 16)
            except ValueError:
                pass
        raise IntegrityError(f"malformed int {node!r} in the object tree")

    def float_(self, node: list[Any]) -> float:
        return _decode_float(node)

    def bytes_(self, node: list[Any]) -> bytes:
        if len(node) == 2 and type(node[1]) is str:
            try:
                return base64.b64decode(node[1], validate=True)
            except (ValueError, binascii.Error):
                pass
        raise IntegrityError(f"malformed bytes {node!r} in the object tree")

    def complex_(self, node: list[Any]) -> complex:
        if len(node) != 3:
            raise IntegrityError(f"malformed complex {node!r} in the object tree")
        return complex(_decode_float(node[1]), _decode_float(node[2]))

    def dtype(self, node: list[Any]) -> torch.dtype:
        value = getattr(torch, node[1], None) if len(node) == 2 and type(node[1]) is str else None
        if not isinstance(value, torch.dtype):
            raise IntegrityError(f"malformed dtype {node!r} in the object tree")
        return value

    def device(self, node: list[Any]) -> torch.device:
        if len(node) == 2 and type(node[1]) is str:
            try:
                return torch.device(node[1])
            except (RuntimeError, ValueError):
                pass
        raise IntegrityError(f"malformed device {node!r} in the object tree")

    def size(self, node: list[Any]) -> torch.Size:
        if len(node) == 2 and type(node[1]) is list and all(type(n) is int and n >= 0 for n in node[1]):
            return torch.Size(node[1])
        raise IntegrityError(f"malformed Size {node!r} in the object tree")

    def pickle_(self, node: list[Any]) -> Any:
        if not self.allow_pickle:
            raise UnsupportedStateError(
                "this version was saved with allow_pickle and holds pickled values; restore it with "
                "`allow_pickle = true` in the cache config, only if you trust whoever wrote it"
            )
        if len(node) != 2 or type(node[1]) is not str:
            raise IntegrityError(f"malformed pickle node {node!r} in the object tree")
        try:
            data = base64.b64decode(node[1], validate=True)
        except (ValueError, binascii.Error):
            raise IntegrityError("malformed pickle node in the object tree") from None
        try:
            return pickle.loads(data)
        except (pickle.UnpicklingError, EOFError) as e:
            raise IntegrityError(f"a pickled value in the object tree is corrupt: {e}") from e


_DECODERS: dict[str, Callable[[_Decoder, list[Any]], Any]] = {
    _LIST: _Decoder.list_,
    _TUPLE: _Decoder.tuple_,
    _DICT: _Decoder.dict_,
    _KDICT: _Decoder.kdict,
    _ODICT: _Decoder.odict,
    _KODICT: _Decoder.kodict,
    _INT: _Decoder.int_,
    _FLOAT: _Decoder.float_,
    _BYTES: _Decoder.bytes_,
    _COMPLEX: _Decoder.complex_,
    _DTYPE: _Decoder.dtype,
    _DEVICE: _Decoder.device,
    _SIZE: _Decoder.size,
    _PICKLE: _Decoder.pickle_,
}
