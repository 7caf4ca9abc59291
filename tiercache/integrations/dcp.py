"""torch.distributed.checkpoint storage on tiercache: ``dcp.save``/``async_save``/``load`` through its tiers.

Usage, on every rank::

    dcp.save(state, storage_writer=TierCacheStorageWriter(cache, step=100))
    dcp.load(state, storage_reader=TierCacheStorageReader(cache, "main"))

DCP plans the checkpoint (which rank writes which shard of which tensor, once for replicated
ones) and reshards on load: a checkpoint saved by 4 ranks loads into 2, or into one process.
tiercache stores it:

- :meth:`TierCacheStorageWriter.write_data` (every rank) lays its write items out as chunks the
  way ``save`` does (big items cut at ``chunk_bytes``, small ones packed together), names each
  chunk by the hash of its bytes and writes the chunks it does not already hold to every durable
  tier of the cache (write-through: DCP's save is synchronous, and ``async_save`` runs it on
  DCP's own thread, so the engine's RAM staging and the placement policy are not involved).
  Unchanged shards (a frozen base model) dedupe against earlier versions, DCP or not.
- :meth:`TierCacheStorageWriter.finish` (the coordinator, once every rank's chunks are durable)
  builds one tiercache version whose tensor table has one entry per saved shard (path
  ``<fqn>@<offsets>``) plus the DCP ``Metadata`` object as the bytes entry
  ``__dcp_metadata__``, writes its manifest to every durable tier and moves the branch ref
  there. ``tiercache ls``/``log`` list DCP checkpoints like any version, and a plain
  ``restore`` returns the shards as a flat dict.
- :class:`TierCacheStorageReader` resolves the ref on rank 0 and shares the manifest with the
  group (one broadcast in ``read_metadata``, so no rank reads a stale view of the branch), then
  reads the shards each rank's plan asks for, each chunk from the fastest tier holding a good
  copy, and narrows them to the requested ranges.

The ``Metadata`` object is stored with pickle, as DCP's own file system storage does, and is
read back with an unpickler that only accepts DCP's metadata classes and plain torch/builtin
values, so a tampered object cannot run code.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
from tiercache.distributed import rebuild_error
from tiercache.errors import ConfigError, IntegrityError, InvalidArgumentError, TierCacheError
from tiercache.format import dtype_from_name, dtype_name
from tiercache.layout import plan_layout
from tiercache.manifest import ChunkRef, Piece, RefRecord, TensorEntry, Version, new_version_id, utcnow
from tiercache.names import check_name
from tiercache.restore import empty_aligned

if TYPE_CHECKING:
    from tiercache.cache import TierCache

#: Path of the tensor-table entry holding the pickled DCP ``Metadata``.
METADATA_ENTRY = "__dcp_metadata__"


@dataclass(frozen=True)
class StoredItem:
    """Where one rank put one write item's bytes (DCP carries it to the coordinator's ``finish``).

    Attributes:
        path: Its entry path in the version (``<fqn>@<offsets>``).
        dtype: Canonical dtype name (``uint8`` for a bytes item).
        shape: The saved shard's shape (``(nbytes,)`` for a bytes item).
        chunks: ``(chunk id, raw length)`` of the chunks its pieces index.
        pieces: ``(chunk index, offset in chunk, offset in item, length)`` runs, in item order.
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[tuple[str, int], ...]
    pieces: tuple[tuple[int, int, int, int], ...]


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


def _durable(cache: TierCache) -> list[str]:
    if not cache.repo.durable:
        raise ConfigError("a DCP checkpoint needs a durable tier (disk or s3): this cache has only RAM")
    return list(cache.repo.durable)


def put_blobs(
    cache: TierCache, blobs: list[torch.Tensor], owner: str
) -> list[tuple[tuple[tuple[str, int], ...], tuple]]:
    """Store flat uint8 blobs as content-addressed chunks on every durable tier, through the storage layer.

    Blobs are laid out like a state's tensors (see :mod:`tiercache.layout`: big ones cut at
    ``chunk_bytes``, small ones packed); chunks a tier already holds are not written again, and
    every chunk is leased for ``owner`` until its version is committed (or ``owner`` is closed).

    Returns:
        Per blob, its chunks ``(id, raw length)`` and its pieces ``(index into those chunks,
        offset in chunk, offset in blob, length)``.
    """
    tiers = _durable(cache)
    cfg = cache.config
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
        codecs.write_header(mv[:hdr], codecs.ChunkHeader(cid, chunk.nbytes, chunk.nbytes, "raw/1", 1, cfg.hash))
        objects[cid] = buf
        ids.append(cid)
    written = [cache.repo.store(owner, name, objects) for name in tiers]
    for name, ids_written in zip(tiers, written, strict=True):
        cache.repo.sync_chunks(name, ids_written)  # before the coordinator commits a manifest naming them
    out = []
    for tensor_pieces in layout.tensor_pieces:
        chunks = tuple((ids[ci], layout.chunks[ci].nbytes) for ci, _ in tensor_pieces)
        pieces = tuple((i, p.chunk_offset, p.offset, p.nbytes) for i, (_, p) in enumerate(tensor_pieces))
        out.append((chunks, pieces))
    return out


class TierCacheStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves a checkpoint as one tiercache version.

    Create one on every rank with the same arguments and pass it to ``dcp.save`` or
    ``dcp.async_save``.

    Args:
        cache: This process's cache (every rank opens its own on the same tiers).
        step: The training step of the checkpoint.
        branch: The branch the version is saved on (the coordinator moves its ref).
        meta: JSON-able metadata for the version.
    """

    def __init__(self, cache: TierCache, *, step: int, branch: str = "main",
                 meta: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        check_name(branch, "branch")
        if isinstance(step, bool) or not isinstance(step, int):
            raise InvalidArgumentError(f"step must be an int, got {step!r}")
        _durable(cache)
        self.cache = cache
        self.step = step
        self.branch = branch
        self.meta = dict(meta or {})
        self.version_id: str | None = None
        self.is_coordinator = False
        self._owner = f"dcp-{new_version_id()}"

    def reset(self, checkpoint_id: Any = None) -> None:
        """Start a new checkpoint; ``checkpoint_id`` is not used (refs name versions)."""
        self.version_id = None
        self.cache.repo.leases.close(self._owner)  # what an earlier checkpoint of this writer leased
        self._owner = f"dcp-{new_version_id()}"

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Record whether this rank is DCP's coordinator (it runs :meth:`finish`)."""
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Return ``plan`` unchanged: chunk names come from content, not from the plan."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Return ``plans`` unchanged."""
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        """Write this rank's items as chunks on every durable tier; see the module docstring."""
        items = list(plan.items)
        blobs, kinds = [], []
        for item in items:
            data, dtype, shape = _item_bytes(item, planner.resolve_data(item))
            blobs.append(data)
            kinds.append((dtype, shape))
        results = []
        stored_blobs = put_blobs(self.cache, blobs, self._owner)
        for item, (chunks, pieces), (dtype, shape), blob in zip(items, stored_blobs, kinds, blobs, strict=True):
            stored = StoredItem(_item_path(item.index), dtype, shape, chunks, pieces)
            results.append(WriteResult(index=item.index, size_in_bytes=blob.numel(), storage_data=stored))
        fut: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit the checkpoint (coordinator only): manifest with the DCP metadata, then the ref."""
        cache = self.cache
        chunks: list[ChunkRef] = []
        where: dict[str, int] = {}
        entries: list[TensorEntry] = []
        storage: dict[MetadataIndex, int] = {}

        def add(stored: StoredItem) -> None:
            for cid, nbytes in stored.chunks:
                if cid not in where:
                    where[cid] = len(chunks)
                    chunks.append(ChunkRef(id=cid, nbytes=nbytes))
            pieces = tuple(Piece(chunk=where[stored.chunks[i][0]], chunk_offset=co, offset=off, nbytes=n)
                           for i, co, off, n in stored.pieces)
            nbytes = sum(p.nbytes for p in pieces)
            entries.append(TensorEntry(path=stored.path, dtype=stored.dtype, shape=stored.shape, nbytes=nbytes,
                                       pieces=pieces))

        for rank_results in results:
            for wr in rank_results:
                storage[wr.index] = len(entries)
                add(wr.storage_data)
        metadata.storage_data = storage
        blob = torch.frombuffer(bytearray(pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)),
                                dtype=torch.uint8)
        (meta_chunks, meta_pieces), = put_blobs(cache, [blob], self._owner)
        add(StoredItem(METADATA_ENTRY, "uint8", (blob.numel(),), meta_chunks, meta_pieces))
        with cache.next_version(self.branch) as nxt:
            version = Version(
                id=new_version_id(), parent=nxt.parent, branch=self.branch, step=self.step,
                created_at=utcnow(), meta=self.meta, hash_algo=cache.config.hash, chunks=tuple(chunks),
                tensors=tuple(entries), tree=["dict", {e.path: ["t", i] for i, e in enumerate(entries)}],
                nbytes=sum(e.nbytes for e in entries),
            )
            ref = RefRecord(kind="branch", name=self.branch, version=version.id, seq=nxt.seq)
            nxt.version = version.id
        try:
            for name in _durable(cache):
                cache.repo.commit(name, version, ref)
        finally:
            cache.repo.leases.close(self._owner)
        cache.repo.adopt(version, _durable(cache))
        self.version_id = version.id

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
        self.storage_data: dict[MetadataIndex, int] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        """Start a new load; ``checkpoint_id``, if given, replaces the ref."""
        if checkpoint_id:
            self.ref = str(checkpoint_id)
        self.version = None

    def _resolve(self) -> Version:
        """The manifest, resolved by rank 0 of the group and shared with every rank."""
        found: list[Any] = [None]
        many = dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1
        first = not many or dist.get_rank(self.group) == 0
        if first:
            try:
                found[0] = ("ok", self.cache.manifest(self.ref).to_json().decode())
            except TierCacheError as e:
                found[0] = ("error", type(e).__name__, str(e))
        if many:
            dist.broadcast_object_list(found, src=dist.get_global_rank(self.group or dist.group.WORLD, 0),
                                       group=self.group)
        if found[0][0] != "ok":
            raise rebuild_error(found[0][1], found[0][2])
        version = Version.from_json(found[0][1].encode(), source=f"manifest of {self.ref!r}")
        self.cache.repo.adopt(version, self.cache.repo.committed_on(version.id))
        return version

    def read_metadata(self) -> Metadata:  # type: ignore[override]  # no rank-local variant to fall back on
        """Resolve the ref (collective) and return the checkpoint's DCP ``Metadata``.

        Raises:
            VersionNotFoundError: If the ref resolves to nothing (on every rank).
            InvalidArgumentError: If the version was not saved through DCP.
        """
        version = self._resolve()
        index = next((i for i, t in enumerate(version.tensors) if t.path == METADATA_ENTRY), None)
        if index is None:
            raise InvalidArgumentError(f"version {version.id} was not saved through DCP: use TierCache.restore")
        (blob,) = self._read(version, [index])
        self.version = version
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

    def _read(self, version: Version, indices: list[int]) -> list[torch.Tensor]:
        """Read entries of ``version`` (in parallel, verified, best tier first) as tensors."""
        entries = [version.tensors[i] for i in indices]
        dests = [empty_aligned(e.shape, dtype_from_name(e.dtype)) for e in entries]
        self.cache.reader.read_version(version.model_copy(update={"tensors": tuple(entries)}), dests)
        return dests

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        """Read the saved shards this rank's plan needs and hand DCP the requested ranges."""
        assert self.version is not None, "read_metadata runs first"
        needed = sorted({self.storage_data[req.storage_index] for req in plan.items})
        saved = dict(zip(needed, self._read(self.version, needed), strict=True))
        for req in plan.items:
            data = saved[self.storage_data[req.storage_index]]
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
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Never picked automatically from a checkpoint id: pass the reader explicitly."""
        return False
