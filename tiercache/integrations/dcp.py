"""torch.distributed.checkpoint storage on tiercache: ``dcp.save``/``async_save``/``load`` through its tiers.

Usage, on every rank::

    dcp.save(state, storage_writer=TierCacheStorageWriter(cache, step=100))
    dcp.load(state, storage_reader=TierCacheStorageReader(cache, "main"))

DCP plans the checkpoint (which rank writes which shard of which tensor, once for replicated
ones) and reshards on load: a checkpoint saved by 4 ranks loads into 2, or into one process.
tiercache stores it as a version like any other, through the same paths as ``save(group=...)``:

- Saved by several ranks, it is a multi-rank version (:mod:`tiercache.parts`): each rank's part
  is its write items (entries ``<fqn>@<offsets>``), laid out as chunks the way ``save`` does
  (big items cut at ``chunk_bytes``, small ones packed) and written by that rank to every
  durable tier it reaches: its node's disk (node-local) and S3 (write-through: DCP's save is
  synchronous, and ``async_save`` runs it on DCP's own thread). The coordinator's part also holds
  DCP's ``Metadata`` object (entry ``__dcp_metadata__``). The group then commits the version
  as it commits any (:mod:`tiercache.group.phases`): the group manifest on S3 by the
  coordinator, on each node's disk by that node's leader, with peer copies (``replicated``) when
  ``[peers] copies`` asks. So a checkpoint of several nodes lives on each node's own disk, and
  survives the loss of a node that has a peer copy. The version id, parent and ref move are
  proposed in ``prepare_global_plan`` and travel to every rank in its plan.
- Saved by one process (``no_dist=True``, or a world of one), it is a single-process version.

Unchanged shards (a frozen base model) dedupe against earlier versions, DCP or not.
:class:`TierCacheStorageReader` resolves the ref for the group, reads the metadata and each
rank's needed entries from its own node, a peer or S3 (a chunk no node holds is read once and
shared), and narrows them to the requested ranges.

:func:`load_whole` and :func:`to_torch_save` read a checkpoint whole in one process, as
``dcp_to_torch_save`` does for a directory (it can only read one).

Both are handed the user's cache and work on its internal interface, which they get from
:func:`tiercache.cache.core_of` (docs/design.md section 1, "The facade and the core").

The ``Metadata`` object is stored with pickle, as DCP's own file system storage does, and is
read back with an unpickler that only accepts DCP's metadata classes and plain torch/builtin
values, so a tampered object cannot run code.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from tiercache import codecs
from tiercache.cache import core_of
from tiercache.errors import ConfigError, IntegrityError, InvalidArgumentError, TierCacheError, VersionNotFoundError
from tiercache.format import dtype_from_name, dtype_name
from tiercache.layout import plan_layout
from tiercache.manifest import ChunkRef, Piece, RefRecord, TensorEntry, Version, check_meta, new_version_id, utcnow
from tiercache.names import check_name
from tiercache.parts import part_of
from tiercache.restore import RestoreReport, empty_aligned

if TYPE_CHECKING:
    from tiercache.cache import TierCache
    from tiercache.core import CacheCore
    from tiercache.group.round import Round
    from tiercache.group.view import GroupView
    from tiercache.handle import SaveHandle

log = logging.getLogger(__name__)

#: Path of the tensor-table entry holding the pickled DCP ``Metadata``.
METADATA_ENTRY = "__dcp_metadata__"


@dataclass(frozen=True)
class StoredItem:
    """Where one write item's bytes are: entry ``index`` of rank ``rank``'s part (``0``: a single-process version).

    DCP carries it to the coordinator's ``finish``, which records it in the ``Metadata`` for loads.
    """

    rank: int
    index: int


def _item_path(index: MetadataIndex) -> str:
    offsets = ",".join(str(o) for o in index.offset) if index.offset is not None else ""
    return f"{index.fqn}@{offsets}"


def _item_bytes(item: WriteItem, data: Any) -> tuple[torch.Tensor, str, tuple[int, ...]]:
    """The item's bytes as a flat uint8 CPU tensor, its dtype name and shape."""
    if item.type == WriteItemType.BYTE_IO:
        raw = bytes(data.getbuffer())
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8), "uint8", (len(raw),)
    t = data.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8), dtype_name(t.dtype), tuple(t.shape)


def _durable(core: CacheCore) -> list[str]:
    if not core.repo.durable:
        raise ConfigError("a DCP checkpoint needs a durable tier (disk or s3): this cache has only RAM")
    return list(core.repo.durable)


def _view(cache: TierCache, group: dist.ProcessGroup | None, *, rank: int | None = None) -> GroupView | None:
    """The cache's group view for a DCP call on ``group``, or ``None`` where DCP runs this process alone.

    DCP runs one process alone without a process group, in a world of one, and with
    ``no_dist=True`` even while a group is up (then every rank, or just one, saves or loads by
    itself: opening the group's view there would wait for ranks that never come).

    Args:
        cache: The user's cache.
        group: The process group of the DCP call.
        rank: The rank DCP told the storage layer (``0`` on every process under ``no_dist``).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return None
    coordinated = _dcp_coordinates()
    if coordinated is None:  # a DCP without the wrapper we look for: its rank still tells, off rank 0
        coordinated = rank is None or rank == dist.get_rank(group)
    if not coordinated:
        return None
    return cast("GroupView", cache.distributed(group))


def _dcp_coordinates() -> bool | None:
    """Whether the running ``dcp.save``/``dcp.load`` coordinates ranks (``False`` under ``no_dist``).

    DCP tells a storage layer its rank and whether it is the coordinator, but not whether it runs
    with ``no_dist``: rank 0 of a live group looks the same either way. DCP's own ``_DistWrapper``,
    a variable of the step that calls the storage layer, knows; ``None`` if no caller has one.
    """
    frame = sys._getframe(1)
    for _ in range(12):
        frame = frame.f_back
        if frame is None:
            return None
        wrapper = frame.f_locals.get("distW")
        if wrapper is not None and isinstance(getattr(wrapper, "use_dist", None), bool):
            return bool(wrapper.use_dist)
    return None


def _checkpoint_name(checkpoint_id: Any, who: str, what: str) -> str:
    """The ref (reader) or tag (writer) a DCP ``checkpoint_id`` names; a path is refused in one line.

    Raises:
        InvalidArgumentError: If ``checkpoint_id`` is a path, or not a valid name.
    """
    text = os.fspath(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else checkpoint_id
    if isinstance(text, bytes) or (isinstance(text, str) and ("/" in text or os.sep in text)) or isinstance(
            checkpoint_id, os.PathLike):
        raise InvalidArgumentError(
            f"{who}: checkpoint_id {text!r} is a path, but a tiercache checkpoint is a version of the cache's "
            f"tiers: leave checkpoint_id out, or give {what}")
    if not isinstance(text, str):
        raise InvalidArgumentError(f"{who}: checkpoint_id must be a string ({what}), got {checkpoint_id!r}")
    return text


class _Entries:
    """A part's entries (one per stored item) and the chunks they name, built as items are stored."""

    def __init__(self) -> None:
        self.chunks: list[ChunkRef] = []
        self.tensors: list[TensorEntry] = []
        self._where: dict[str, int] = {}

    def add(self, path: str, dtype: str, shape: tuple[int, ...], stored: tuple[tuple[tuple[str, int], ...], tuple]
            ) -> int:
        """Add one entry; return its index."""
        chunks, pieces = stored
        for cid, nbytes in chunks:
            if cid not in self._where:
                self._where[cid] = len(self.chunks)
                self.chunks.append(ChunkRef(id=cid, nbytes=nbytes))
        runs = tuple(Piece(chunk=self._where[chunks[i][0]], chunk_offset=co, offset=off, nbytes=n)
                     for i, co, off, n in pieces)
        self.tensors.append(TensorEntry(path=path, dtype=dtype, shape=shape, nbytes=sum(p.nbytes for p in runs),
                                        pieces=runs))
        return len(self.tensors) - 1

    def version(self, **fields: Any) -> Version:
        """The version (or part) these entries make, with ``fields`` (id, parent, branch...)."""
        return Version(chunks=tuple(self.chunks), tensors=tuple(self.tensors),
                       tree=["dict", {e.path: ["t", i] for i, e in enumerate(self.tensors)}],
                       nbytes=sum(e.nbytes for e in self.tensors), **fields)


def put_blobs(
    core: CacheCore, blobs: list[torch.Tensor], owner: str
) -> list[tuple[tuple[tuple[str, int], ...], tuple]]:
    """Store flat uint8 blobs as content-addressed chunks on every durable tier, through the storage layer.

    Blobs are laid out like a state's tensors (see :mod:`tiercache.layout`: big ones cut at
    ``chunk_bytes``, small ones packed); chunks a tier already holds are not written again, and
    every chunk is leased for ``owner`` until its version is committed (or ``owner`` is closed).
    On a node-local tier (a node's disk) this rank's chunks go to its own node.

    Returns:
        Per blob, its chunks ``(id, raw length)`` and its pieces ``(index into those chunks,
        offset in chunk, offset in blob, length)``.
    """
    tiers = _durable(core)
    cfg = core.config
    layout = plan_layout([b.numel() for b in blobs], [1] * len(blobs), chunk_bytes=cfg.chunk_bytes,
                         pack_below=cfg.pack_below)
    hdr = codecs.HEADER_BYTES
    objects: dict[str, bytearray] = {}
    ids: list[str] = []
    for chunk in layout.chunks:
        buf = bytearray(hdr + chunk.nbytes)
        view = torch.frombuffer(buf, dtype=torch.uint8)
        for p in chunk.pieces:
            src = blobs[p.tensor][p.offset : p.offset + p.nbytes]
            view[hdr + p.chunk_offset : hdr + p.chunk_offset + p.nbytes].copy_(src)
        mv = memoryview(buf)
        cid = codecs.content_id(mv[hdr:], cfg.hash)
        codecs.seal_chunk(mv, cid, cfg.hash)
        objects[cid] = buf
        ids.append(cid)
    written = [core.repo.store(owner, name, objects) for name in tiers]
    for name, ids_written in zip(tiers, written, strict=True):
        core.repo.sync_chunks(name, ids_written)  # before a manifest names them
    out = []
    for tensor_pieces in layout.tensor_pieces:
        chunks = tuple((ids[ci], layout.chunks[ci].nbytes) for ci, _ in tensor_pieces)
        pieces = tuple((i, p.chunk_offset, p.offset, p.nbytes) for i, (_, p) in enumerate(tensor_pieces))
        out.append((chunks, pieces))
    return out


class TierCacheStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves a checkpoint as one tiercache version.

    Create one on every rank with the same arguments and pass it to ``dcp.save`` or
    ``dcp.async_save`` (its default thread executor: the writer holds the open cache, which
    cannot move to another process, so the process executor is refused). With several ranks,
    DCP's coordinator must be rank 0 of the group (DCP's default); do not run a DCP save and a
    ``save(group=...)`` of the same group concurrently.

    One writer may serve many saves: each starts from fresh state, whether or not DCP calls
    :meth:`reset`. ``checkpoint_id``, if given, names a tag for the version (a path is refused).
    With ``no_dist=True`` each process that saves makes a version of its own, as with one
    process; so does each rank with ``use_collectives=False`` (give each rank its own branch or
    cache then: the ranks do not agree on a version).

    Args:
        cache: This process's cache (every rank opens its own on the same tiers).
        step: The training step of the checkpoint.
        branch: The branch the version is saved on (the group moves its ref).
        meta: JSON-able metadata for the version.
        group: The process group ``dcp.save`` runs on (default: the world, if initialized).
    """

    def __init__(self, cache: TierCache, *, step: int, branch: str = "main",
                 meta: Mapping[str, Any] | None = None, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        check_name(branch, "branch")
        if isinstance(step, bool) or not isinstance(step, int):
            raise InvalidArgumentError(f"step must be an int, got {step!r}")
        core = core_of(cache)
        _durable(core)
        self.cache = cache
        self._core = core
        self.step = step
        self.branch = branch
        self.meta = check_meta(meta)
        self.group = group
        self.version_id: str | None = None
        #: With several ranks: the version's handle on this rank (every level but ``staged``).
        self.handle: SaveHandle | None = None
        self.is_coordinator = False
        self._view: GroupView | None = None
        self._round: Round | None = None
        self._entries = _Entries()
        self._rank = 0
        self._owner = f"dcp-{new_version_id()}"
        self._named: str | None = None  # checkpoint_id of the coming save (reset), then its tag
        self._tag: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("TierCacheStorageWriter holds the open cache, which cannot move to another process: "
                        "use dcp.async_save with its default thread executor "
                        "(async_checkpointer_type=AsyncCheckpointerType.THREAD)")

    def reset(self, checkpoint_id: Any = None) -> None:
        """Start a new checkpoint; a ``checkpoint_id`` names a tag the version gets once committed.

        Raises:
            InvalidArgumentError: If ``checkpoint_id`` is a path or not a valid tag name.
        """
        if checkpoint_id is not None:
            self._named = check_name(_checkpoint_name(checkpoint_id, "TierCacheStorageWriter", "a tag name"), "tag")
        self._fresh()

    def _fresh(self) -> None:
        """Forget the last checkpoint's entries and round, so that the next save starts from nothing.

        DCP calls :meth:`reset` only when a ``checkpoint_id`` is given: a writer used for a second
        save without one would otherwise append to the first save's entries (and a load would
        find the first save's metadata).
        """
        rnd = self._round
        if rnd is None or rnd.futures["durable"].done():
            self._core.repo.leases.close(self._owner)  # what an earlier checkpoint of this writer leased
        # (else the round's own callback frees them once the group settles it)
        self.version_id = None
        self.handle = None
        self._round = None
        self._entries = _Entries()
        self._owner = f"dcp-{new_version_id()}"

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Start this save from fresh state; record whether this rank is DCP's coordinator; open the group's view.

        Raises:
            InvalidArgumentError: If DCP's coordinator is not rank 0 of the group.
        """
        if self._entries.tensors or self._round is not None:
            self._fresh()
        self._tag, self._named = self._named, None
        self.is_coordinator = is_coordinator
        alone = kwargs.get("use_collectives") is False  # every rank plans, writes and finishes by itself
        self._view = None if alone else _view(self.cache, self.group, rank=kwargs.get("rank"))
        self._rank = self._view.rank if self._view is not None else 0
        if self._view is not None and is_coordinator and self._rank != 0:
            raise InvalidArgumentError("TierCacheStorageWriter: DCP's coordinator must be rank 0 of the group "
                                       "(leave dcp.save's coordinator_rank at its default)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Return ``plan`` unchanged: chunk names come from content, not from the plan."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Propose the version (coordinator): its id, parent and ref move travel to every rank in its plan."""
        if self._view is None:
            return plans
        agreed = self._view.propose(self.branch, self.step, self.meta)
        return [dataclasses.replace(p, storage_data=agreed) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        """Write this rank's items as chunks on every durable tier it reaches; see the module docstring."""
        view = self._view
        rnd = self._round = view.open_round(plan.storage_data) if view is not None else None
        if rnd is not None:
            self.version_id, self.handle = rnd.vid, rnd.handle()
            owner, core = self._owner, self._core
            # Whatever the outcome (committed, failed, or DCP aborted the checkpoint): the group
            # settles every level, and the chunks leased for it are free then.
            rnd.futures["durable"].add_done_callback(lambda _: core.repo.leases.close(owner))
            if self._tag is not None and not self.is_coordinator:
                # The coordinator tags in finish(), on its node; every other rank on its own
                # node's tiers, once the group committed the version.
                tag, self._tag = self._tag, None
                rnd.futures["durable"].add_done_callback(lambda f: self._tag_committed(f, tag, rnd.vid))
        try:
            items = list(plan.items)
            blobs, kinds = [], []
            for item in items:
                data, dtype, shape = _item_bytes(item, planner.resolve_data(item))
                blobs.append(data)
                kinds.append((dtype, shape))
            results = []
            for item, stored, (dtype, shape), blob in zip(items, put_blobs(self._core, blobs, self._owner), kinds,
                                                          blobs, strict=True):
                index = self._entries.add(_item_path(item.index), dtype, shape, stored)
                results.append(WriteResult(index=item.index, size_in_bytes=blob.numel(),
                                           storage_data=StoredItem(self._rank, index)))
        except BaseException as e:
            if rnd is not None:
                assert rnd.published is not None
                rnd.published.set_exception(e)  # the group fails the version with this rank's error
            raise
        if rnd is not None:
            rnd.wrote.set()  # the coordinator's part waits for finish(): see phases' _coordinator_part
            if not self.is_coordinator:
                self._publish(rnd)
        fut: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        fut.set_result(results)
        return fut

    def _publish(self, rnd: Round) -> None:
        """Hand this rank's part to the group: write it to every durable tier, then let the phases commit."""
        assert rnd.published is not None
        core = self._core
        own = self._entries.version(id=rnd.vid, parent=None, branch=rnd.ref.name, step=rnd.step,
                                    created_at=rnd.created_at, hash_algo=core.config.hash)
        rnd.published.set_result(own)
        part = part_of(own, self._rank)
        for tier in core.repo.durable:
            try:
                core.repo.put_part(tier, part)
            except BaseException as e:
                rnd.ready[tier].set_exception(e)
                continue
            rnd.ready[tier].set_result(None)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit the checkpoint (coordinator only): its metadata, then the version and the ref.

        Raises:
            TierCacheError: If the version reached no durable tier (with several ranks: the
                group's error, naming the rank).
        """
        core = self._core
        rnd = self._round
        try:
            # Plain tuples: the loader's unpickler accepts DCP's classes and builtins only.
            metadata.storage_data = {wr.index: (wr.storage_data.rank, wr.storage_data.index)
                                     for rank_results in results for wr in rank_results}
            blob = torch.frombuffer(bytearray(pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)),
                                    dtype=torch.uint8)
            (stored,) = put_blobs(core, [blob], self._owner)
            self._entries.add(METADATA_ENTRY, "uint8", (blob.numel(),), stored)
        except BaseException as e:
            if rnd is not None:
                assert rnd.published is not None
                rnd.published.set_exception(e)  # the group fails the version naming rank 0 and this error
            raise
        if rnd is not None:
            self._publish(rnd)
            rnd.futures["durable"].result()  # the group's outcome: raises its error
            self.version_id = rnd.vid
            self._tag_version()
            return
        with core.next_version(self.branch) as nxt:
            version = self._entries.version(id=new_version_id(), parent=nxt.parent, branch=self.branch,
                                            step=self.step, created_at=utcnow(), meta=self.meta,
                                            hash_algo=core.config.hash)
            ref = RefRecord(kind="branch", name=self.branch, version=version.id, seq=nxt.seq)
            nxt.version = version.id
        try:
            for name in _durable(core):
                core.repo.commit(name, version, ref)
        finally:
            core.repo.leases.close(self._owner)
        core.repo.adopt(version, _durable(core))
        self.version_id = version.id
        self._tag_version()

    def _tag_committed(self, durable: Future[Any], tag: str, vid: str) -> None:
        """Tag ``vid`` on this rank's tiers once the group committed it (a callback of its ``durable``)."""
        if durable.exception() is not None:
            return  # the version failed: the save raised on every rank, and there is nothing to tag
        try:
            self.cache.tag(tag, vid)
        except TierCacheError as e:
            log.error("DCP checkpoint %s: tag %r not written on this rank's tiers: %s", vid, tag, e)

    def _tag_version(self) -> None:
        """Tag the committed version with the save's ``checkpoint_id``, if it had one."""
        if self._tag is not None and self.version_id is not None:
            tag, self._tag = self._tag, None
            self.cache.tag(tag, self.version_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Never picked automatically from a checkpoint id: pass the writer explicitly."""
        return False


_SAFE_TORCH = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``Metadata`` and nothing that could run code."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, _SAFE_TORCH) or value is torch.Size:
                return value
        raise IntegrityError(f"DCP metadata names {module}.{name}, which is not a metadata class")


_SAFE_GLOBALS = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                 ("torch.serialization", "_get_layout")}


def _load_metadata(data: bytes) -> Metadata:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise IntegrityError(f"the DCP metadata of this version cannot be read: {e}") from e
    if not isinstance(metadata, Metadata):
        raise IntegrityError(f"the DCP metadata entry holds a {type(metadata).__name__}, not Metadata")
    return metadata


class TierCacheStorageReader(StorageReader):
    """A DCP ``StorageReader`` that loads a checkpoint saved by :class:`TierCacheStorageWriter`.

    Create one on every rank and pass it to ``dcp.load``; the ranks may be more or fewer than
    those that saved it (DCP's planner reshards).

    Args:
        cache: This process's cache.
        ref: The version to load: a branch, tag, id, ``NAME~N`` or ``NAME@STEP``.
        group: The process group ``dcp.load`` runs on (default: the world, if initialized).
    """

    def __init__(self, cache: TierCache, ref: str = "main", *, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.cache = cache
        self.ref = ref
        self.group = group
        self.version: Version | None = None
        self.storage_data: dict[MetadataIndex, tuple[int, int]] = {}
        self._source: _Source | None = None
        self._t0 = 0.0

    def reset(self, checkpoint_id: Any = None) -> None:
        """Start a new load; ``checkpoint_id``, if given, replaces the ref (a path is refused).

        Raises:
            InvalidArgumentError: If ``checkpoint_id`` is a path.
        """
        if checkpoint_id is not None:
            self.ref = _checkpoint_name(checkpoint_id, "TierCacheStorageReader",
                                        "a ref of the cache (branch, tag, id, NAME~N, NAME@STEP)")
        self.version = None
        self._source = None

    # No **kwargs: DCP would then retry a failed read as a rank-local one, without collectives.
    def read_metadata(self) -> Metadata:  # type: ignore[override]  # no rank-local variant to fall back on
        """Resolve the ref (for the group: collective) and return the checkpoint's DCP ``Metadata``.

        Raises:
            VersionNotFoundError: If the ref resolves to nothing (on every rank).
            InvalidArgumentError: If the version was not saved through DCP.
        """
        self._t0 = time.perf_counter()
        view = _view(self.cache, self.group)
        self._source = _Local(self.cache, self.ref) if view is None else _Group(view, self.ref)
        where = self._source.metadata()
        if where is None:
            raise InvalidArgumentError(f"version {self._source.vid} was not saved through DCP: use TierCache.restore")
        (blob,) = self._source.read([where])
        return _load_metadata(blob.numpy().tobytes())

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Keep the map from DCP's storage indices to entries of the version."""
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Return ``plan`` unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Return ``plans`` unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        """Read the saved shards this rank's plan needs and hand DCP the requested ranges (collective)."""
        assert self._source is not None, "read_metadata runs first"
        needed = sorted({StoredItem(*self.storage_data[req.storage_index]) for req in plan.items},
                        key=lambda s: (s.rank, s.index))
        saved = dict(zip(needed, self._source.read(needed), strict=True))
        for req in plan.items:
            data = saved[StoredItem(*self.storage_data[req.storage_index])]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(data.numpy().tobytes()))
                continue
            src = narrow_tensor_by_index(data, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != src.size():
                raise IntegrityError(f"{req.storage_index.fqn}: saved range is {list(src.size())}, "
                                     f"the plan wants {list(target.size())}")
            target.copy_(src)
            planner.commit_tensor(req, target)
        # As a restore reports it: what this rank read, per source, and the load's time from the
        # ref's resolution on (the group's exchanges included).
        core_of(self.cache).last_restore = RestoreReport(self._source.vid, dict(self._source.nbytes),
                                                         time.perf_counter() - self._t0)
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Never picked automatically from a checkpoint id: pass the reader explicitly."""
        return False


def load_whole(cache: TierCache, ref: str = "main") -> dict[str, Any]:
    """The whole state a DCP checkpoint holds, read by this process alone (no target state needed).

    What ``dcp_to_torch_save`` reads from a directory, for a checkpoint of this cache: sharded
    tensors come back whole, as the saving ranks' plan laid them out.

    Args:
        cache: The cache holding the checkpoint.
        ref: The version: a branch, tag, id, ``NAME~N`` or ``NAME@STEP``.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=TierCacheStorageReader(cache, ref), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)  # as dcp_to_torch_save calls it: dcp.load would warn for an empty state
    return state


def to_torch_save(cache: TierCache, ref: str, path: str | os.PathLike[str]) -> None:
    """Write a DCP checkpoint of this cache as one ``torch.save`` file (``dcp_to_torch_save`` for a cache).

    Run it on one rank: the whole state is held in this process's memory.
    """
    torch.save(load_whole(cache, ref), path)


def _select(entries: list[tuple[TensorEntry, tuple[ChunkRef, ...]]], vid: str, algo: str) -> Version:
    """A version holding just ``entries`` (each with the chunk table its pieces index), to read them."""
    chunks: list[ChunkRef] = []
    where: dict[str, int] = {}
    tensors = []
    for entry, table in entries:
        pieces = []
        for p in entry.pieces:
            c = table[p.chunk]
            if c.id not in where:
                where[c.id] = len(chunks)
                chunks.append(c)
            pieces.append(p.model_copy(update={"chunk": where[c.id]}))
        tensors.append(entry.model_copy(update={"path": f"{len(tensors)}", "pieces": tuple(pieces)}))
    return Version(id=vid, parent=None, branch="main", step=0, created_at=utcnow(), hash_algo=algo,  # type: ignore[arg-type]
                   chunks=tuple(chunks), tensors=tuple(tensors), tree=None, nbytes=sum(t.nbytes for t in tensors))


def _tensors(version: Version) -> list[torch.Tensor]:
    return [empty_aligned(e.shape, dtype_from_name(e.dtype)) for e in version.tensors]


class _Source(ABC):
    """Where a load reads a DCP checkpoint's entries from (:class:`_Local` or :class:`_Group`)."""

    vid: str
    #: Raw chunk bytes read so far, per source (``ram``, ``disk``, ``peer``, ``s3``).
    nbytes: dict[str, int]

    def _count(self, read: Mapping[str, int]) -> None:
        for source, n in read.items():
            self.nbytes[source] = self.nbytes.get(source, 0) + n

    @abstractmethod
    def metadata(self) -> StoredItem | None:
        """Where the DCP metadata entry is, or ``None`` if this is no DCP checkpoint."""

    @abstractmethod
    def read(self, items: list[StoredItem]) -> list[torch.Tensor]:
        """The bytes of ``items`` as tensors of their saved dtype and shape."""


class _Local(_Source):
    """One process reads a version it can read whole (single-process, or every part on its tiers)."""

    def __init__(self, cache: TierCache, ref: str) -> None:
        self.core = core_of(cache)
        self.version = self.core.catalog.get(cache.resolve(ref))
        self.vid = self.version.id
        self.nbytes = {}

    def _entry(self, item: StoredItem) -> TensorEntry:
        v = self.version
        return v.tensors[v.parts[item.rank].first + item.index] if v.parts else v.tensors[item.index]

    def metadata(self) -> StoredItem | None:
        v = self.version
        ranks = [(r, p.first, p.count) for r, p in enumerate(v.parts)] or [(0, 0, len(v.tensors))]
        for rank, first, count in ranks:
            for i in range(count):
                if v.tensors[first + i].path.endswith(METADATA_ENTRY):
                    return StoredItem(rank, i)
        return None

    def read(self, items: list[StoredItem]) -> list[torch.Tensor]:
        version = _select([(self._entry(s), self.version.chunks) for s in items], self.vid, self.version.hash_algo)
        dests = _tensors(version)
        self._count(self.core.reader.read_version(version, dests))
        return dests


class _Group(_Source):
    """The ranks of a group read a multi-rank version: each the parts it needs, from its node, a peer or S3."""

    def __init__(self, view: GroupView, ref: str) -> None:
        from tiercache.group.restore import header_of, resolve

        self.view = view
        slot = view.slot("dcp-load")
        self.tag = f"dcp-load/{slot}"
        self.what = f"the group's DCP load of {ref!r}"
        self._reads = 0
        self.nbytes = {}
        found = resolve(view, view.channel, self.tag, self.what, ref)
        self.vid = found["id"]
        self.world = found["world"]
        cat = view.core.catalog
        try:
            self.header = cat.peek(self.vid)
        except VersionNotFoundError:
            self.header = header_of(found)

    def metadata(self) -> StoredItem | None:
        part = self._parts([0], "metadata")[0]
        index = next((i for i, t in enumerate(part.tensors) if t.path == METADATA_ENTRY), None)
        return None if index is None else StoredItem(0, index)

    def _parts(self, ranks: list[int], what: str) -> dict[int, Version]:
        from tiercache.group.restore import fetch_parts

        self._reads += 1
        if self.world == 1:  # a single-process checkpoint: every rank reads it whole
            version = self.view.core.catalog.get(self.vid)
            return {0: version}
        return fetch_parts(self.view, self.view.channel, f"{self.tag}/{self._reads}", f"{self.what} ({what})",
                           self.header, ranks)

    def read(self, items: list[StoredItem]) -> list[torch.Tensor]:
        from tiercache.group.restore import GroupFill

        parts = self._parts(sorted({s.rank for s in items}), "parts")
        version = _select([(parts[s.rank].tensors[s.index], parts[s.rank].chunks) for s in items], self.vid,
                          self.header.hash_algo)
        dests = _tensors(version)
        fill = GroupFill(self.view, self.view.channel, f"{self.tag}/{self._reads}", self.what)
        self._count(fill(version, dests, None))
        return dests
