"""The hasher: names each staged chunk by the hash of its bytes and publishes the version's manifest.

It runs on a ``tiercache-hash`` thread of the engine (one per rank whose versions it hashes:
one in a trainer, one per local rank in a node agent), chunk by chunk as each is copied (unless
the copy keeps every core busy: then after the whole copy). Naming a chunk writes its header in
place in the arena and hands the region to the RAM tier (:mod:`tiercache.pipeline.ramcache`),
which completes the chunk's ``ready`` future: the writers start on it from there.

A multi-rank version whose caller declared chunks alike on every rank
(:class:`~tiercache.pipeline.job.HashSplit`, see :mod:`tiercache.group.hashing`) trades their ids
once per version, always (with ``None`` after a failure), so no rank waits in vain; the group fails
the version if the ranks' ids differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
from datetime import UTC, datetime

from tiercache import codecs
from tiercache.config import CacheConfig
from tiercache.layout import Layout
from tiercache.manifest import ChunkRef, Version
from tiercache.names import chunk_key, version_key
from tiercache.pipeline.job import Job, JobTable
from tiercache.pipeline.ramcache import RamCache
from tiercache.repo import Repo
from tiercache.tensor_table import TensorTable
from tiercache.tiers.ram import Region


class Hasher:
    """Names the chunks of each version and publishes its manifest (one thread per rank calls :meth:`run`).

    Args:
        config: The cache config (its hash algorithm).
        repo: The storage layer: the catalog learns the RAM copies and the manifest.
        ramcache: The RAM arena and tier the named chunks go to.
        jobs: The jobs in flight (their lock guards regions and the RAM tier).
        wait_for_copy: Hash only once the whole version is copied (the copy uses every core).
    """

    def __init__(self, config: CacheConfig, repo: Repo, ramcache: RamCache, jobs: JobTable, *,
                 wait_for_copy: bool) -> None:
        self.config = config
        self.repo = repo
        self.ramcache = ramcache
        self.jobs = jobs
        self.wait_for_copy = wait_for_copy
        # The last hashed version's layout, chunk ids, and which chunks differed from the one
        # before it: where a chunk changed last time, a writer writes it early again.
        self._last: tuple[Layout, list[str], list[bool]] | None = None

    def changed(self, layout: Layout) -> list[bool] | None:
        """Per chunk, whether it changed between the last two versions hashed, if the last had ``layout``."""
        with self.jobs.lock:
            last = self._last
        return last[2] if last is not None and last[0] is layout else None

    @property
    def last_layout(self) -> Layout | None:
        """The layout of the last version hashed (``None`` before the first)."""
        with self.jobs.lock:
            return self._last[0] if self._last is not None else None

    def run(self, job: Job) -> None:
        """Name every chunk of ``job`` and publish its manifest; raise if its copy or hashing failed."""
        ram = self.ramcache
        assert ram.arena is not None
        algo = self.config.hash
        hdr = codecs.HEADER_BYTES
        chunks = job.layout.chunks
        ids: list[str] = [""] * len(chunks)
        # A multi-rank version compares the ids of the chunks its ranks declared alike.
        split = job.committer.split_hashing(job.layout, [m.path for m in job.flat.metas]) if job.committer else None
        traded = split is None

        def trade(mine: dict[int, str] | None) -> None:
            nonlocal traded
            traded = True
            assert split is not None
            split.exchange(mine)

        if self.wait_for_copy:
            # Every core is copying for the training thread: hashing now would only slow it.
            for e in job.copied:
                e.wait()
        try:
            for i in range(len(chunks)):
                job.copied[i].wait()
                if job.copy_error is not None:
                    raise job.copy_error
                region = job.regions[i]
                assert region is not None
                buf = ram.arena.buffer(region)
                ids[i] = codecs.content_id(buf[hdr : hdr + chunks[i].nbytes], algo)
                self._name_chunk(job, i, ids[i], buf, region)
            if not traded:
                trade(dict(enumerate(ids)))
        except BaseException:
            if not traded:
                # The group's other hashers are waiting for this one's ids; this error is the one to report.
                with contextlib.suppress(Exception):
                    trade(None)
            raise
        self._publish(job, ids)

    def _name_chunk(self, job: Job, i: int, cid: str, buf: memoryview, region: Region) -> None:
        """Write chunk ``i``'s header (its id ``cid``) in place and hand its region to the RAM tier."""
        c = job.layout.chunks[i]
        hdr = codecs.HEADER_BYTES
        codecs.seal_chunk(buf[: hdr + c.nbytes], cid, self.config.hash, itemsize=c.itemsize)
        key = chunk_key(cid)
        with self.jobs.lock:
            # (An early write still reading this copy retained it: it goes back after.)
            self.ramcache.adopt(key, region, hdr + c.nbytes)
            job.regions[i] = None
            job.chunk_keys.append(key)
        self.repo.stored("ram", [cid])
        job.ready[i].set_result(cid)

    def _publish(self, job: Job, ids: list[str]) -> None:
        """Build the version's manifest from its chunk ids and make it known (RAM tier, catalog)."""
        ram = self.ramcache
        assert ram.ram is not None
        metas = job.flat.metas
        # Straight into the table's columns: no object per tensor or piece (docs/design.md, section 2).
        tensors = TensorTable.of(
            [m.path for m in metas], [m.dtype for m in metas], [m.shape for m in metas], [m.nbytes for m in metas],
            [[(ci, p.chunk_offset, p.offset, p.nbytes) for ci, p in tp] for tp in job.layout.tensor_pieces])
        manifest = Version(
            id=job.version_id, parent=job.parent, branch=job.branch, step=job.step,
            created_at=datetime.fromtimestamp(job.created_at, UTC), meta=job.meta, hash_algo=self.config.hash,
            chunks=tuple(ChunkRef(id=cid, nbytes=c.nbytes) for cid, c in zip(ids, job.layout.chunks, strict=True)),
            tensors=tensors, tree=job.flat.tree, pickled=job.flat.pickled, nbytes=job.nbytes,
        )
        job.manifest = manifest
        job.flat = dataclasses.replace(job.flat, tensors=[])  # drop references to the caller's tensors
        if job.committer is None:
            with self.jobs.lock:
                ram.ram.put(version_key(job.version_id), manifest.to_json())
            self.repo.catalog.add(manifest, "ram")
        # else: one rank's part of a group's version is no version of its own: the group makes the
        # version known once it commits it (a part alone must never be listed, restored or copied).
        job.published.set_result(manifest)
        with self.jobs.lock:
            prev = self._last
            changed = ([a != b for a, b in zip(prev[1], ids, strict=True)] if prev and prev[0] is job.layout
                       else [True] * len(ids))
            self._last = (job.layout, ids, changed)
        ram.notify()


__all__ = ["Hasher"]
