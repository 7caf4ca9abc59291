"""Versions, refs and ref strings: the metadata that describes what is stored.

A :class:`Version` manifest is written as ``versions/<id>.json`` on every durable tier that holds
the version, after all its chunks and before any ref points at it. A :class:`RefRecord` is the
content of ``refs/branch/<name>`` or ``refs/tag/<name>``; ``seq`` grows by one on every move so
that, when tiers disagree (the disk has a newer head than S3 while an upload is in flight), the
record with the highest ``seq`` wins.

Manifests are validated on load: every id and name is checked, and every tensor piece must lie
inside its chunk and its tensor, so a damaged or hostile manifest is refused with
:class:`~tiercache.errors.IntegrityError` instead of leading reads astray.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tiercache.errors import IntegrityError, InvalidNameError
from tiercache.names import check_chunk_id, check_name

MANIFEST_SCHEMA = 1

_DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ChunkRef(_Model):
    """One chunk of a version: its content id and raw (uncompressed) length."""

    id: str
    nbytes: int = Field(ge=0)

    @model_validator(mode="after")
    def _check(self) -> ChunkRef:
        check_chunk_id(self.id)
        return self


class Piece(_Model):
    """A contiguous run of a tensor's bytes stored inside one chunk.

    Attributes:
        chunk: Index into :attr:`Version.chunks`.
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


class RankPart(_Model):
    """One rank's part of a multi-rank version (see :mod:`tiercache.distributed`).

    Attributes:
        first: Index in :attr:`Version.tensors` of the rank's first tensor; its tensors are a
            contiguous run of the table.
        count: How many tensors the rank saved.
        tree: The rank's object tree, its tensor indices counted from 0 within its run.
        pickled: Whether some leaf of the rank's state was stored with pickle.
    """

    first: int = Field(ge=0)
    count: int = Field(ge=0)
    tree: Any
    pickled: bool = False


class Version(_Model):
    """The manifest of one checkpoint version.

    Attributes:
        schema_version: Manifest schema version.
        id: Sortable unique id (26 Crockford base32 characters, time first).
        parent: Id of the version this one was saved after on its branch, or ``None``.
        branch: Branch the version was saved on.
        step: Training step given to ``save``.
        created_at: When ``save`` was called (UTC).
        meta: User metadata (JSON).
        hash_algo: Content hash naming the chunks.
        chunks: The chunks, in layout order.
        tensors: The tensor table, in the order of the tree's tensor indices.
        tree: The object tree (JSON) with tensors replaced by their indices.
        pickled: Whether some leaf was stored with pickle (restore then needs ``allow_pickle``).
        nbytes: Total tensor bytes.
        parts: For a version saved by several ranks, each rank's part in rank order (the tree
            is then the list of the ranks' states); empty for a single-process version, and then
            left out of the stored JSON so that older readers still parse it.
    """

    schema_version: Literal[1] = MANIFEST_SCHEMA
    id: str
    parent: str | None
    branch: str
    step: int
    created_at: datetime
    meta: dict[str, Any] = Field(default_factory=dict)
    hash_algo: Literal["xxh3-128", "blake2b"] = "xxh3-128"
    chunks: tuple[ChunkRef, ...]
    tensors: tuple[TensorEntry, ...]
    tree: Any
    pickled: bool = False
    nbytes: int = Field(ge=0)
    parts: tuple[RankPart, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> Version:
        check_name(self.id, "version id")
        check_name(self.branch, "branch")
        if self.parent is not None:
            check_name(self.parent, "parent version id")
        total = 0
        for t in self.tensors:
            size = _DTYPE_SIZES.get(t.dtype)
            if size is None:
                raise ValueError(f"tensor {t.path!r}: unknown dtype {t.dtype!r}")
            if any(d < 0 for d in t.shape) or math.prod(t.shape) * size != t.nbytes:
                raise ValueError(f"tensor {t.path!r}: shape {t.shape} does not match {t.nbytes} bytes")
            covered = 0
            for p in t.pieces:
                if p.chunk >= len(self.chunks):
                    raise ValueError(f"tensor {t.path!r}: piece names chunk {p.chunk} of {len(self.chunks)}")
                if p.chunk_offset + p.nbytes > self.chunks[p.chunk].nbytes or p.offset + p.nbytes > t.nbytes:
                    raise ValueError(f"tensor {t.path!r}: piece lies outside its chunk or tensor")
                covered += p.nbytes
            if covered != t.nbytes:
                raise ValueError(f"tensor {t.path!r}: pieces cover {covered} of {t.nbytes} bytes")
            total += t.nbytes
        if total != self.nbytes:
            raise ValueError(f"nbytes {self.nbytes} is not the sum of the tensors ({total})")
        end = 0
        for r, part in enumerate(self.parts):
            if part.first != end or part.first + part.count > len(self.tensors):
                raise ValueError(f"rank part {r} does not follow the previous one inside the tensor table")
            end = part.first + part.count
        if self.parts and end != len(self.tensors):
            raise ValueError(f"rank parts cover {end} of {len(self.tensors)} tensors")
        return self

    def to_json(self) -> bytes:
        """Serialize for storage."""
        return self.model_dump_json(exclude=None if self.parts else {"parts"}).encode()

    @classmethod
    def from_json(cls, data: bytes, *, source: str = "manifest") -> Version:
        """Parse and validate a stored manifest.

        Raises:
            IntegrityError: If the bytes are not a valid manifest.
        """
        try:
            return cls.model_validate_json(data)
        except (ValidationError, InvalidNameError, ValueError) as e:
            raise IntegrityError(f"{source} is not a valid tiercache manifest: {_first_error(e)}") from e


class RefRecord(_Model):
    """The content of a ref object."""

    schema_version: Literal[1] = MANIFEST_SCHEMA
    kind: Literal["branch", "tag"]
    name: str
    version: str
    seq: int = Field(ge=0)

    @model_validator(mode="after")
    def _check(self) -> RefRecord:
        check_name(self.name, self.kind)
        check_name(self.version, "version id")
        return self

    def to_json(self) -> bytes:
        """Serialize for storage."""
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, data: bytes, *, source: str = "ref") -> RefRecord:
        """Parse and validate a stored ref.

        Raises:
            IntegrityError: If the bytes are not a valid ref record.
        """
        try:
            return cls.model_validate_json(data)
        except (ValidationError, InvalidNameError, ValueError) as e:
            raise IntegrityError(f"{source} is not a valid tiercache ref: {_first_error(e)}") from e


def _first_error(e: Exception) -> str:
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        return f"{loc}: {err['msg']}" if loc else err["msg"]
    return str(e)


@dataclass(frozen=True)
class VersionInfo:
    """What ``TierCache.versions()`` reports about one version.

    Attributes:
        id: Version id.
        step: Training step.
        branch: Branch it was saved on.
        parent: Parent version id, or ``None``.
        created_at: Creation time (UTC).
        nbytes: Total tensor bytes.
        meta: User metadata.
        tiers: Tiers that hold every chunk of the version, fastest first.
    """

    id: str
    step: int
    branch: str
    parent: str | None
    created_at: datetime
    nbytes: int
    meta: dict[str, Any]
    tiers: tuple[str, ...]


_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_id_lock = threading.Lock()
_last_id: list[int] = [0, 0]


def new_version_id() -> str:
    """Return a new sortable unique version id (ULID layout: 48-bit ms time, 80 random bits).

    Ids made in one process are strictly increasing even within one millisecond.
    """
    with _id_lock:
        ms = time.time_ns() // 1_000_000
        if ms <= _last_id[0]:
            ms, rnd = _last_id[0], _last_id[1] + 1
        else:
            rnd = int.from_bytes(os.urandom(10), "big") >> 1  # headroom so increments never overflow
        _last_id[0], _last_id[1] = ms, rnd
    value = (ms << 80) | rnd
    return "".join(_CROCKFORD[(value >> (5 * i)) & 31] for i in range(25, -1, -1))


def utcnow() -> datetime:
    """Current time as an aware UTC datetime."""
    return datetime.now(UTC)


_REF_RE = re.compile(r"(?P<base>[^~@]+)(?:~(?P<back>\d+)|@(?P<step>-?\d+))?")


@dataclass(frozen=True)
class RefSpec:
    """A parsed user ref string: ``NAME``, ``NAME~N`` or ``NAME@STEP``."""

    base: str
    back: int = 0
    step: int | None = None


def parse_ref(ref: object) -> RefSpec:
    """Parse ``NAME``, ``NAME~N`` (N versions before) or ``NAME@STEP``.

    Raises:
        InvalidNameError: If the string is not one of these forms or the name is invalid.
    """
    if not isinstance(ref, str):
        raise InvalidNameError(f"invalid ref {ref!r}: expected a string such as main, main~2 or main@1000")
    m = _REF_RE.fullmatch(ref)
    if m is None:
        raise InvalidNameError(f"invalid ref {ref!r}: use NAME, NAME~N or NAME@STEP")
    check_name(m.group("base"), "ref")
    back = int(m.group("back")) if m.group("back") else 0
    step = int(m.group("step")) if m.group("step") is not None else None
    return RefSpec(m.group("base"), back, step)
