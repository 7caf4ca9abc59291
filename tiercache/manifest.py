"""Versions, refs and ref strings: the metadata that describes what is stored.

A :class:`Version` manifest is written as ``versions/<id>.json`` on every durable tier that holds
the version, after all its chunks and before any ref points at it. A :class:`RefRecord` is the
content of ``refs/branch/<name>`` or ``refs/tag/<name>``; ``seq`` grows by one on every move so
that, when tiers disagree (the disk has a newer head than S3 while an upload is in flight), the
record with the highest ``seq`` wins.

Manifests are validated on load: every id and name is checked, and every tensor piece must lie
inside its chunk and its tensor, so a damaged or hostile manifest is refused with
:class:`~tiercache.errors.IntegrityError` instead of leading reads astray.

Every stored object (manifest, part, ref, record) is *sealed*: its JSON is followed by a line
``#xxh3-128:<digest of the JSON bytes>``, checked on load before anything is parsed. A flipped
bit anywhere (a renamed key, a changed scalar, a piece moved within bounds) is then an
``IntegrityError`` naming where it was read, never a wrong restore; a tier's damaged copy is
left out and the copy of another tier is used. Objects written before seals existed (no seal
line) are parsed as they are: any bit flipped in a seal line leaves bytes that are not JSON.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal, TypeVar

import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tiercache.errors import IntegrityError, InvalidArgumentError, InvalidNameError
from tiercache.gcpause import gc_paused
from tiercache.names import check_chunk_id, check_name

# Piece and TensorEntry are part of the manifest's vocabulary; they live with the table.
from tiercache.tensor_table import Piece as Piece
from tiercache.tensor_table import TensorEntry as TensorEntry
from tiercache.tensor_table import TensorTable

MANIFEST_SCHEMA = 1
#: A version manifest's schema: 2 stores the tensor table as columns (:mod:`tiercache.tensor_table`);
#: manifests of schema 1 (a list of tensor objects) still parse.
VERSION_SCHEMA = 2

class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


_Self = TypeVar("_Self", bound="_Stored")

#: What separates a stored object's JSON from the digest that seals it (see the module docstring).
_SEAL = b"\n#xxh3-128:"


def seal(body: bytes) -> bytes:
    """``body`` (a stored object's JSON) followed by its seal line."""
    return body + _SEAL + xxhash.xxh3_128_hexdigest(body).encode()


def unseal(data: bytes, where: str) -> bytes:
    """The JSON of a stored object, once its seal matches (an object without a seal is returned whole).

    Raises:
        IntegrityError: If the seal does not match the bytes it seals.
    """
    at = data.rfind(_SEAL)
    if at < 0:
        return data  # written before seals: parsing checks what it can
    body = data[:at]
    if data[at + len(_SEAL):] != xxhash.xxh3_128_hexdigest(body).encode():
        raise IntegrityError(f"{where} is damaged: its bytes do not match their checksum")
    return body


class _Stored(_Model):
    """A model stored as one JSON object on the tiers; ``_what`` names it in errors."""

    _what: ClassVar[str] = "object"

    def to_json(self) -> bytes:
        """Serialize for storage, sealed."""
        return seal(self.model_dump_json().encode())

    @classmethod
    def from_json(cls: type[_Self], data: bytes, *, source: str = "") -> _Self:
        """Parse and validate a stored object.

        Raises:
            IntegrityError: If the bytes are not a valid object of this kind.
        """
        where = source or cls._what
        body = unseal(bytes(data), where)
        try:
            with gc_paused():  # a manifest of many tensors is a large object graph (tiercache.gcpause)
                return cls.model_validate_json(body)
        except (ValidationError, InvalidNameError, ValueError) as e:
            raise IntegrityError(f"{where} is not a valid tiercache {cls._what}: {_first_error(e)}") from e


class ChunkRef(_Model):
    """One chunk of a version: its content id and raw (uncompressed) length."""

    id: str
    nbytes: int = Field(ge=0)

    @model_validator(mode="after")
    def _check(self) -> ChunkRef:
        check_chunk_id(self.id)
        return self


class RankPart(_Model):
    """One rank's part of a multi-rank version, merged (see :mod:`tiercache.parts`).

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


class NodePart(_Model):
    """One node of a multi-rank version: which ranks ran there and who holds copies of its part.

    Attributes:
        name: The node's name (``TIERCACHE_NODE``, torchrun's node, or the host name).
        domain: Its failure domain (``TIERCACHE_FAILURE_DOMAIN``), ``""`` if none was given.
        ranks: The ranks that ran on it; the node's part is their parts.
        copies: The other nodes chosen to hold a copy of the node's part on their node-local
            disk (``peers.copies`` of them); the save's ``replicated`` level says when they do.
    """

    name: str
    domain: str = ""
    ranks: tuple[int, ...]
    copies: tuple[str, ...] = ()


class Version(_Stored):
    """The manifest of one checkpoint version.

    Attributes:
        schema_version: Manifest schema version (2; 1 for manifests written before the tensor
            table was stored as columns).
        id: Sortable unique id (26 Crockford base32 characters, time first).
        parent: Id of the version this one was saved after on its branch, or ``None``.
        branch: Branch the version was saved on.
        step: Training step given to ``save``.
        created_at: When ``save`` was called (UTC).
        meta: User metadata (JSON).
        hash_algo: Content hash naming the chunks.
        chunks: The chunks, in layout order.
        tensors: The tensor table, in the order of the tree's tensor indices (given as a sequence of
            :class:`TensorEntry`, held as columns: :class:`~tiercache.tensor_table.TensorTable`).
        tree: The object tree (JSON) with tensors replaced by their indices.
        pickled: Whether some leaf was stored with pickle (restore then needs ``allow_pickle``).
        nbytes: Total tensor bytes.
        parts: For a version saved by several ranks, each rank's part in rank order (the tree
            is then the list of the ranks' states); empty for a single-process version, and then
            left out of the stored JSON so that older readers still parse it.
        nodes: For a multi-rank version, the nodes its ranks ran on (see :class:`NodePart`);
            empty otherwise (and then left out of the stored JSON too).
        ranks: For a multi-rank version stored as a group manifest and one part manifest per
            rank (``parts/<id>/<rank>.json``, see :mod:`tiercache.parts`), how many ranks saved
            it; ``0`` otherwise. Stored, such a version has no chunks, tensors or tree of its own
            (:attr:`is_header`); once its parts are read it is their merge
            (:func:`tiercache.parts.merge`), with :attr:`parts` set too.
        rank: Set in a part manifest: this is rank ``rank``'s part of group version :attr:`id`.
    """

    schema_version: Literal[1, 2] = VERSION_SCHEMA
    id: str
    parent: str | None
    branch: str
    step: int
    created_at: datetime
    meta: dict[str, Any] = Field(default_factory=dict)
    hash_algo: Literal["xxh3-128", "blake2b"] = "xxh3-128"
    chunks: tuple[ChunkRef, ...]
    tensors: TensorTable
    tree: Any
    pickled: bool = False
    nbytes: int = Field(ge=0)
    parts: tuple[RankPart, ...] = ()
    nodes: tuple[NodePart, ...] = ()
    ranks: int = Field(default=0, ge=0)
    rank: int | None = Field(default=None, ge=0)

    @field_validator("schema_version")
    @classmethod
    def _current_schema(cls, value: int) -> int:
        # Held (and so written again) as the current schema: the table is columns once parsed.
        return VERSION_SCHEMA

    @model_validator(mode="after")
    def _check(self) -> Version:
        check_name(self.id, "version id")
        check_name(self.branch, "branch")
        if self.parent is not None:
            check_name(self.parent, "parent version id")
        total = self.tensors.check([c.nbytes for c in self.chunks])
        if self.rank is not None and (self.parts or self.ranks or self.nodes):
            raise ValueError("a part manifest holds one rank's part only (no parts, ranks or nodes)")
        if self.is_header:
            if self.tensors or self.chunks:
                raise ValueError("a group manifest names its ranks' parts and holds no tensors or chunks itself")
        elif self.ranks and self.ranks != len(self.parts):
            raise ValueError(f"{self.ranks} ranks but {len(self.parts)} merged parts")
        if total != self.nbytes and not self.is_header:
            raise ValueError(f"nbytes {self.nbytes} is not the sum of the tensors ({total})")
        end = 0
        for r, part in enumerate(self.parts):
            if part.first != end or part.first + part.count > len(self.tensors):
                raise ValueError(f"rank part {r} does not follow the previous one inside the tensor table")
            end = part.first + part.count
        if self.parts and end != len(self.tensors):
            raise ValueError(f"rank parts cover {end} of {len(self.tensors)} tensors")
        if self.nodes:
            names = [n.name for n in self.nodes]
            ranks = sorted(r for n in self.nodes for r in n.ranks)
            if ranks != list(range(self.ranks or len(self.parts))) or len(set(names)) != len(names):
                raise ValueError("nodes must name each rank part once, under distinct node names")
            if any(c not in names or c == n.name for n in self.nodes for c in n.copies):
                raise ValueError("a node's copies must name other nodes of the version")
        return self

    _what: ClassVar[str] = "manifest"

    @property
    def is_header(self) -> bool:
        """Whether this is a group manifest whose parts have not been read (see :attr:`ranks`)."""
        return self.ranks > 0 and not self.parts

    @property
    def world(self) -> int:
        """How many ranks saved this version (1 for a single-process version)."""
        return self.ranks or len(self.parts) or 1

    def header(self) -> Version:
        """The group manifest of a multi-rank version saved split (itself if it is one already)."""
        if not self.ranks or not self.parts:
            return self
        return self.model_copy(update={"chunks": (), "tensors": (), "tree": None, "pickled": False, "parts": ()})

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Version:
        """A copy with ``update`` applied; a ``tensors`` update may be any sequence of :class:`TensorEntry`."""
        if update is not None and "tensors" in update:
            update = {**update, "tensors": TensorTable.coerce(update["tensors"])}
        return super().model_copy(update=update, deep=deep)

    def rank_chunk_ids(self, ranks: Iterable[int]) -> frozenset[str]:
        """The chunks the parts of ``ranks`` name (this version's parts must be merged)."""
        t = self.tensors
        return frozenset(self.chunks[c].id
                         for r in ranks
                         for c in set(t.chunk[t.starts[self.parts[r].first]
                                              : t.starts[self.parts[r].first + self.parts[r].count]].tolist()))

    def to_json(self) -> bytes:
        """Serialize for storage (leaving out empty multi-rank fields, so older readers still parse it).

        A multi-rank version whose parts were merged in memory is stored as its group manifest
        (:meth:`header`): its parts are stored apart, by their ranks.
        """
        me = self.header()
        empty = {name for name in ("parts", "nodes", "ranks") if not getattr(me, name)}
        if me.rank is None:
            empty.add("rank")
        return seal(me.model_dump_json(exclude=empty or None).encode())


class RefRecord(_Stored):
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

    _what: ClassVar[str] = "ref"


class TierOutcome(_Model):
    """Why a tier does not hold a version: it was skipped there, its write failed, or it was evicted.

    Attributes:
        state: ``skipped`` (by the policy), ``failed`` (the write's error) or ``evicted``.
        reason: The policy's reason or the error, in words.
        at: When it happened (UTC).
    """

    state: Literal["skipped", "failed", "evicted"]
    reason: str = ""
    at: datetime = Field(default_factory=lambda: datetime.now(UTC))


class VersionStatus(_Stored):
    """The content of ``status/<id>.json``: per tier that does not hold the version, why not."""

    schema_version: Literal[1] = MANIFEST_SCHEMA
    version: str
    tiers: dict[str, TierOutcome]

    @model_validator(mode="after")
    def _check(self) -> VersionStatus:
        check_name(self.version, "version id")
        for name in self.tiers:
            check_name(name, "tier")
        return self

    _what: ClassVar[str] = "status record"


class PrunedRecord(_Stored):
    """The content of ``pruned/<id>.json``: a version a user-set rule deleted from its last durable tier.

    It keeps the version's place in its lineage (``NAME~N`` walks past it) and says why it is
    gone (``restore`` of it names the rule and the time).

    Attributes:
        version: The version id.
        branch: Its branch.
        step: Its step.
        parent: Its parent's id.
        nbytes: Its tensor bytes.
        created_at: When it was saved.
        rule: The rule that deleted it (``retention latest = 3``...).
        tier: The tier it was deleted from last.
        at: When (UTC).
    """

    schema_version: Literal[1] = MANIFEST_SCHEMA
    version: str
    branch: str
    step: int
    parent: str | None
    nbytes: int
    created_at: datetime
    rule: str
    tier: str
    at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    @model_validator(mode="after")
    def _check(self) -> PrunedRecord:
        check_name(self.version, "version id")
        return self

    _what: ClassVar[str] = "pruned record"

    def why(self) -> str:
        """``pruned by <rule> at <time>`` (the time in UTC, to the second)."""
        return f"pruned by {self.rule} at {self.at.strftime('%Y-%m-%d %H:%M:%S')} UTC"


#: Why a branch or tag moved somewhere its history does not simply continue.
MoveReason = Literal["save", "rollback", "resume", "branch", "tag"]


class RefMove(_Stored):
    """One reflog entry: a branch or tag move, and the version it left behind.

    Saves that continue a branch's history are not logged (the versions' parents are that
    history, and ``TierCache.reflog`` reports them as ``save`` moves); rollbacks, resumes from
    an older version, new branches and tags are, so the versions they leave behind stay
    reachable for ``reflog_keep`` seconds.

    Attributes:
        id: Sortable unique id of the entry.
        kind: ``branch`` or ``tag``.
        name: The ref's name.
        version: Where it moved to.
        previous: Where it was before (``None`` for a new ref).
        seq: The ref's ``seq`` after the move.
        at: When (UTC).
        why: ``save``, ``rollback``, ``resume`` (a save after restoring an older version),
            ``branch`` or ``tag``.
    """

    schema_version: Literal[1] = MANIFEST_SCHEMA
    id: str
    kind: Literal["branch", "tag"]
    name: str
    version: str
    previous: str | None
    seq: int = Field(ge=0)
    at: datetime
    why: MoveReason

    @model_validator(mode="after")
    def _check(self) -> RefMove:
        check_name(self.id, "reflog entry id")
        check_name(self.name, self.kind)
        check_name(self.version, "version id")
        if self.previous is not None:
            check_name(self.previous, "version id")
        return self

    _what: ClassVar[str] = "reflog entry"


def _first_error(e: Exception) -> str:
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        return f"{loc}: {err['msg']}" if loc else err["msg"]
    return str(e)


TierStateName = Literal["held", "pending", "skipped", "failed", "evicted", "pruned", "absent"]


@dataclass(frozen=True)
class TierState:
    """Where a version stands on one tier.

    Attributes:
        state: ``held`` (the tier holds every chunk and the manifest), ``pending`` (this
            process is still writing it there), ``skipped`` (the policy skipped it there),
            ``failed`` (the write failed), ``evicted`` (dropped there later), ``pruned`` (a
            rule the user set deleted it from its last durable tier: see ``TierCache.pruned``), or ``absent``
            (not there, for no recorded reason: another process wrote it, or a record was lost).
        reason: Why, in words (empty for ``held`` and ``pending``).
        at: When that happened, where known.
    """

    state: TierStateName
    reason: str = ""
    at: datetime | None = None


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
        states: For every configured tier, where the version stands there and why (so a
            version that missed S3 during an outage says so).
    """

    id: str
    step: int
    branch: str
    parent: str | None
    created_at: datetime
    nbytes: int
    meta: dict[str, Any]
    tiers: tuple[str, ...]
    states: dict[str, TierState] = field(default_factory=dict)


def left_behind(versions: Sequence[VersionInfo], refs: Mapping[str, str]) -> set[str]:
    """Ids of the versions saved on a branch that its history no longer holds (a rollback or resume left them).

    A branch's history is its head and the head's ancestors. Where that walk meets a parent no
    tier holds, what lies beyond is unknown: versions of the branch older than that parent (ids
    sort by time) are not counted as left behind.

    Args:
        versions: Every version listed (``TierCache.versions()`` and ``pruned()``).
        refs: Every ref (``{"branch/main": id, ...}``).
    """
    by_id = {v.id: v for v in versions}
    history: dict[str, tuple[set[str], str]] = {}
    for key, head in refs.items():
        kind, _, name = key.partition("/")
        if kind != "branch":
            continue
        seen: set[str] = set()
        cur: str | None = head
        while cur is not None and cur in by_id and cur not in seen:
            seen.add(cur)
            cur = by_id[cur].parent
        history[name] = (seen, cur if cur is not None and cur not in by_id else "")
    return {v.id for v in versions
            if v.branch in history and v.id not in history[v.branch][0] and v.id > history[v.branch][1]}


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


def check_meta(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """``meta`` as a dict, if it is JSON-able (what a version's ``meta`` may hold).

    Raises:
        InvalidArgumentError: If it holds anything JSON cannot carry (or NaN/inf).
    """
    out = dict(meta or {})
    try:
        json.dumps(out, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"meta must be JSON-able (plain numbers, strings, lists, dicts): {e}") from None
    return out


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
