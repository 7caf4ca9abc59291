"""A version's tensor table, held and stored as columns.

A manifest names every tensor of the state: its key path, dtype, shape, size, and the pieces of
chunks its bytes lie in. Stored as one JSON object per tensor and piece, a state of 100k tensors
made a 17.8 MB manifest that took 1.8 s to parse and validate, most of a restore of tiny tensors.
:class:`TensorTable` keeps the same table as columns: the paths as a JSON list of strings, the
dtypes as indices into a short list of names, and every number column as one base64 string of
little-endian integers of the narrowest width that holds it. Parsing is a few ``frombuffer``
calls, and the checks a manifest must pass (every piece inside its chunk and its tensor, the
pieces covering each tensor, shapes matching sizes) run over whole columns (docs/design.md,
section 2).

Manifests written before the columns (``tensors`` a list of objects) still parse: they are
validated object by object as they always were and then held as columns.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, TypeAdapter
from pydantic_core import core_schema

from tiercache.dtypes import DTYPES

#: The stored table's layout version (the ``columns`` key of its JSON object).
COLUMNS_FORMAT = 1

#: Sizes, offsets and dims above this are refused: sums and products of a few of them stay
#: inside int64, so the checks cannot be fooled by overflow.
_MAX_VALUE = 1 << 48

_WIDTHS = (("u1", 1 << 8), ("u2", 1 << 16), ("u4", 1 << 32), ("u8", 1 << 64))


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Piece(_Model):
    """A contiguous run of a tensor's bytes stored inside one chunk.

    Attributes:
        chunk: Index into :attr:`tiercache.manifest.Version.chunks`.
        chunk_offset: Where the run starts inside the chunk's raw bytes.
        offset: Where the run starts inside the tensor's bytes.
        nbytes: Length of the run.
    """

    chunk: int = Field(ge=0)
    chunk_offset: int = Field(ge=0)
    offset: int = Field(ge=0)
    nbytes: int = Field(gt=0)


class TensorEntry(_Model):
    """A tensor of the state: its path, dtype, shape and where its bytes are."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int = Field(ge=0)
    pieces: tuple[Piece, ...]


_OLD_TABLE = TypeAdapter(tuple[TensorEntry, ...])


def _encode_ints(values: np.ndarray) -> str:
    """``<width>:<base64>`` of non-negative ints, in the narrowest unsigned width that holds them."""
    top = int(values.max()) if values.size else 0
    width = next(w for w, limit in _WIDTHS if top < limit)
    return f"{width}:" + base64.b64encode(values.astype("<" + width).tobytes()).decode("ascii")


def _decode_ints(text: object, count: int, what: str) -> np.ndarray:
    if not isinstance(text, str) or text[2:3] != ":" or text[:2] not in {w for w, _ in _WIDTHS}:
        raise ValueError(f"tensors.{what}: expected '<width>:<base64>', got {str(text)[:40]!r}")
    try:
        raw = base64.b64decode(text[3:], validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"tensors.{what}: not base64 ({e})") from None
    dtype = np.dtype("<" + text[:2])
    if len(raw) != count * dtype.itemsize:
        raise ValueError(f"tensors.{what}: {len(raw)} bytes do not hold {count} values of {dtype.itemsize} bytes")
    out = np.frombuffer(raw, dtype=dtype)
    if out.size and int(out.max()) >= _MAX_VALUE:
        raise ValueError(f"tensors.{what}: a value is out of range")
    return out.astype(np.int64)


class TensorTable(Sequence[TensorEntry]):
    """The tensor table of a version, as columns (see the module docstring).

    Indexing gives :class:`TensorEntry` objects, built on demand; the read path uses the
    columns directly.

    Attributes:
        paths: Key path per tensor.
        dtypes: Dtype name per tensor.
        shapes: Shape per tensor.
        nbytes: Bytes per tensor (int64).
        starts: Tensor ``i``'s pieces are pieces ``starts[i]`` to ``starts[i + 1]`` (int64, one longer
            than the table).
        chunk: Per piece, the index of its chunk (int64).
        chunk_offset: Per piece, where it starts in the chunk (int64).
        offset: Per piece, where it starts in its tensor (int64).
        piece_nbytes: Per piece, its length (int64).
    """

    __slots__ = ("_dims", "chunk", "chunk_offset", "dtypes", "nbytes", "offset", "paths", "piece_nbytes", "shapes",
                 "starts")

    def __init__(
        self,
        paths: list[str],
        dtypes: list[str],
        shapes: list[tuple[int, ...]],
        nbytes: np.ndarray,
        starts: np.ndarray,
        chunk: np.ndarray,
        chunk_offset: np.ndarray,
        offset: np.ndarray,
        piece_nbytes: np.ndarray,
    ) -> None:
        self.paths = paths
        self.dtypes = dtypes
        self.shapes = shapes
        self.nbytes = nbytes
        self.starts = starts
        self.chunk = chunk
        self.chunk_offset = chunk_offset
        self.offset = offset
        self.piece_nbytes = piece_nbytes
        self._dims: tuple[np.ndarray, np.ndarray] | None = None  # (ndim, dims) where known already

    def _shape_columns(self) -> tuple[np.ndarray, np.ndarray]:
        """The shapes as columns: rank per tensor, and every tensor's sizes one after the other.

        Raises:
            ValueError: If a shape holds something other than sizes that fit int64.
        """
        if self._dims is None:
            ndim = np.fromiter(map(len, self.shapes), dtype=np.int64, count=len(self.shapes))
            try:
                dims = np.fromiter((d for s in self.shapes for d in s), dtype=np.int64, count=int(ndim.sum()))
            except (OverflowError, TypeError, ValueError):
                raise ValueError("tensor table: a shape holds something other than sizes") from None
            self._dims = (ndim, dims)
        return self._dims

    # ------------------------------------------------------------------ building

    @classmethod
    def of(
        cls,
        paths: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        nbytes: Sequence[int],
        pieces: Sequence[Sequence[tuple[int, int, int, int]]],
    ) -> TensorTable:
        """A table from per-tensor lists, each tensor's pieces as ``(chunk, chunk_offset, offset, nbytes)``.

        Unchecked: :meth:`check` it against the version's chunks (a :class:`~tiercache.manifest.Version` does).
        """
        flat = [p for ps in pieces for p in ps]
        counts = np.fromiter((len(ps) for ps in pieces), dtype=np.int64, count=len(pieces))
        columns = np.array(flat, dtype=np.int64).reshape(len(flat), 4).T
        return cls(list(paths), list(dtypes), [tuple(s) for s in shapes], np.array(nbytes, dtype=np.int64).reshape(-1),
                   np.concatenate(([0], np.cumsum(counts))).astype(np.int64),
                   columns[0].copy(), columns[1].copy(), columns[2].copy(), columns[3].copy())

    @classmethod
    def from_entries(cls, entries: Iterable[TensorEntry]) -> TensorTable:
        """The table of ``entries``."""
        entries = list(entries)
        return cls.of([e.path for e in entries], [e.dtype for e in entries], [e.shape for e in entries],
                      [e.nbytes for e in entries],
                      [[(p.chunk, p.chunk_offset, p.offset, p.nbytes) for p in e.pieces] for e in entries])

    @classmethod
    def empty(cls) -> TensorTable:
        """A table of no tensors."""
        return cls.from_entries(())

    @classmethod
    def coerce(cls, value: object) -> TensorTable:
        """A table from what a manifest holds: a table, the stored columns, or a list of entries (old format).

        Raises:
            ValueError: If ``value`` is none of these, or does not hold together (the message says where).
        """
        if isinstance(value, TensorTable):
            return value
        if isinstance(value, dict):
            return cls._from_columns(value)
        if isinstance(value, list | tuple) and all(isinstance(e, TensorEntry) for e in value):
            return cls.from_entries(value)
        return cls.from_entries(_OLD_TABLE.validate_python(value))

    @classmethod
    def _from_columns(cls, doc: dict[str, Any]) -> TensorTable:
        if doc.get("columns") != COLUMNS_FORMAT:
            raise ValueError(f"tensors: unknown table layout {doc.get('columns')!r} "
                             f"(this tiercache reads {COLUMNS_FORMAT})")
        known = {"columns", "count", "path", "dtype_names", "dtype", "ndim", "dims", "nbytes", "pieces", "chunk",
                 "chunk_offset", "offset", "piece_nbytes"}
        if set(doc) != known:
            raise ValueError(f"tensors: expected the fields {sorted(known)}, got {sorted(doc)}")
        n = doc["count"]
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < _MAX_VALUE:
            raise ValueError(f"tensors.count: expected a count, got {n!r}")
        paths, names = doc["path"], doc["dtype_names"]
        if not isinstance(paths, list) or len(paths) != n or not all(isinstance(p, str) for p in paths):
            raise ValueError(f"tensors.path: expected {n} strings")
        if not isinstance(names, list) or not all(isinstance(d, str) and d in DTYPES for d in names):
            raise ValueError(f"tensors.dtype_names: expected dtype names, got {str(names)[:80]}")
        kinds = _decode_ints(doc["dtype"], n, "dtype")
        if kinds.size and int(kinds.max()) >= len(names):
            raise ValueError("tensors.dtype: an index names no dtype")
        ndim = _decode_ints(doc["ndim"], n, "ndim")
        dims = _decode_ints(doc["dims"], int(ndim.sum()), "dims")
        nbytes = _decode_ints(doc["nbytes"], n, "nbytes")
        counts = _decode_ints(doc["pieces"], n, "pieces")
        starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        m = int(starts[-1])
        if n and int(ndim.min()) == int(ndim.max()):  # all of one rank (the common case): no slicing per tensor
            shapes = list(map(tuple, dims.reshape(n, int(ndim[0])).tolist()))
        else:
            dim_list = dims.tolist()
            ends = np.cumsum(ndim).tolist()
            shapes = [tuple(dim_list[e - k : e]) for e, k in zip(ends, ndim.tolist(), strict=True)]
        table = cls(
            paths, [names[k] for k in kinds.tolist()], shapes, nbytes, starts,
            _decode_ints(doc["chunk"], m, "chunk"), _decode_ints(doc["chunk_offset"], m, "chunk_offset"),
            _decode_ints(doc["offset"], m, "offset"), _decode_ints(doc["piece_nbytes"], m, "piece_nbytes"),
        )
        table._dims = (ndim, dims)
        return table

    def encode(self) -> dict[str, Any]:
        """The stored form: a JSON object of columns (see the module docstring)."""
        names = sorted(set(self.dtypes))
        index = {d: i for i, d in enumerate(names)}
        ndim, dims = self._shape_columns()
        return {
            "columns": COLUMNS_FORMAT, "count": len(self), "path": list(self.paths), "dtype_names": names,
            "dtype": _encode_ints(np.fromiter(map(index.__getitem__, self.dtypes), dtype=np.int64, count=len(self))),
            "ndim": _encode_ints(ndim), "dims": _encode_ints(dims), "nbytes": _encode_ints(self.nbytes),
            "pieces": _encode_ints(np.diff(self.starts)), "chunk": _encode_ints(self.chunk),
            "chunk_offset": _encode_ints(self.chunk_offset), "offset": _encode_ints(self.offset),
            "piece_nbytes": _encode_ints(self.piece_nbytes),
        }

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        """Validate with :meth:`coerce`, serialize with :meth:`encode` (no per-tensor model)."""
        return core_schema.no_info_plain_validator_function(
            cls.coerce, serialization=core_schema.plain_serializer_function_ser_schema(lambda t: t.encode()))

    # ------------------------------------------------------------------ checking

    def check(self, chunk_nbytes: Sequence[int]) -> int:
        """Check the table against the version's chunks; return the total tensor bytes.

        Every dtype must be known, every shape must match its tensor's size, every piece must lie
        inside its chunk and its tensor, and each tensor's pieces must add up to its size.

        Raises:
            ValueError: Naming the first tensor that does not hold together.
        """
        n = len(self)
        if not (len(self.dtypes) == len(self.shapes) == self.nbytes.size == n and self.starts.size == n + 1):
            raise ValueError("tensor table: its columns differ in length")
        sizes_of = {d: DTYPES[d].itemsize if d in DTYPES else -1 for d in set(self.dtypes)}
        itemsize = np.fromiter(map(sizes_of.__getitem__, self.dtypes), np.int64, count=n)
        if n and int(itemsize.min()) < 0:
            i = int(np.argmin(itemsize))
            raise ValueError(f"tensor {self.paths[i]!r}: unknown dtype {self.dtypes[i]!r}")
        ndim, dims = self._shape_columns()
        wrong = (dims < 0) | (dims >= _MAX_VALUE)
        if wrong.any():
            i = int(np.repeat(np.arange(n), ndim)[int(np.argmax(wrong))])
            raise ValueError(f"tensor {self.paths[i]!r}: shape {self.shapes[i]} has a size out of range")
        begins = np.cumsum(ndim) - ndim
        numel = np.ones(n, dtype=np.int64)
        bad = np.zeros(n, dtype=bool)
        for k in range(int(ndim.max()) if n else 0):
            has = ndim > k
            d = np.ones(n, dtype=np.int64)
            d[has] = dims[begins[has] + k]
            bad |= (numel > 0) & (d > _MAX_VALUE // np.maximum(numel, 1))  # the product could pass any size
            numel = np.where(bad, 0, numel * d)
        bad |= numel * itemsize != self.nbytes
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"tensor {self.paths[i]!r}: shape {self.shapes[i]} does not match {int(self.nbytes[i])} bytes")
        counts = np.diff(self.starts)
        if (counts < 0).any() or int(self.starts[0]) != 0 or int(self.starts[-1]) != self.chunk.size or not (
                self.chunk.size == self.chunk_offset.size == self.offset.size == self.piece_nbytes.size):
            raise ValueError("tensor table: its piece columns differ in length")
        owner = np.repeat(np.arange(n, dtype=np.int64), counts)
        sizes = np.asarray(chunk_nbytes, dtype=np.int64)
        for what, wrong in (
            ("names a chunk the version does not have", (self.chunk < 0) | (self.chunk >= sizes.size)),
            ("has an empty or negative piece", (self.piece_nbytes <= 0) | (self.offset < 0) | (self.chunk_offset < 0)),
        ):
            if wrong.any():
                i = int(owner[int(np.argmax(wrong))])
                raise ValueError(f"tensor {self.paths[i]!r}: a piece {what}")
        outside = (self.chunk_offset + self.piece_nbytes > sizes[self.chunk]) | (
            self.offset + self.piece_nbytes > self.nbytes[owner])
        if outside.any():
            i = int(owner[int(np.argmax(outside))])
            raise ValueError(f"tensor {self.paths[i]!r}: piece lies outside its chunk or tensor")
        total = np.concatenate(([0], np.cumsum(self.piece_nbytes)))
        covered = total[self.starts[1:]] - total[self.starts[:-1]]
        short = covered != self.nbytes
        if short.any():
            i = int(np.argmax(short))
            raise ValueError(f"tensor {self.paths[i]!r}: pieces cover {int(covered[i])} of {int(self.nbytes[i])} bytes")
        return int(self.nbytes.sum())

    # ------------------------------------------------------------------ as a sequence of entries

    def __len__(self) -> int:
        return len(self.paths)

    def entry(self, i: int) -> TensorEntry:
        """Tensor ``i`` as a :class:`TensorEntry` (built without validation: the table was checked)."""
        a, b = int(self.starts[i]), int(self.starts[i + 1])
        pieces = tuple(
            Piece.model_construct(chunk=c, chunk_offset=co, offset=o, nbytes=nb)
            for c, co, o, nb in zip(self.chunk[a:b].tolist(), self.chunk_offset[a:b].tolist(),
                                    self.offset[a:b].tolist(), self.piece_nbytes[a:b].tolist(), strict=True)
        )
        return TensorEntry.model_construct(path=self.paths[i], dtype=self.dtypes[i], shape=self.shapes[i],
                                           nbytes=int(self.nbytes[i]), pieces=pieces)

    @overload
    def __getitem__(self, i: int) -> TensorEntry: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[TensorEntry, ...]: ...
    def __getitem__(self, i: int | slice) -> TensorEntry | tuple[TensorEntry, ...]:
        if isinstance(i, slice):
            return tuple(self.entry(k) for k in range(*i.indices(len(self))))
        if not -len(self) <= i < len(self):
            raise IndexError(f"tensor {i} of {len(self)}")
        return self.entry(i % len(self))

    def __iter__(self) -> Iterator[TensorEntry]:
        return (self.entry(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorTable):
            return (self.paths == other.paths and self.dtypes == other.dtypes and self.shapes == other.shapes
                    and all(np.array_equal(getattr(self, c), getattr(other, c))
                            for c in ("nbytes", "starts", "chunk", "chunk_offset", "offset", "piece_nbytes")))
        if isinstance(other, tuple | list):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TensorTable({len(self)} tensors, {self.chunk.size} pieces)"


__all__ = ["COLUMNS_FORMAT", "Piece", "TensorEntry", "TensorTable"]
