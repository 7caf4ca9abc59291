"""The catalog's index: what listing and ref resolution need of every version, without its manifest.

Each durable tier keeps, next to the manifests, an index of one JSON line per version
(:class:`Summary`: id, parent, branch, step, time, size, meta, chunk ids, bytes per dtype), one
per pruned record and one per write of a status record (why a tier lacks a version: the last line
of a version counts), in segments of at most :data:`SEGMENT` lines (``index/<kind>/<n>.jsonl``).
A commit appends its version's line after the manifest is durable and before the ref moves
(docs/design.md section 2), rewriting only the last segment, so a save's cost does not grow with
the history.

The manifests stay the truth; the index is a cache of them. On every tier a reader lists the
manifests' names at each open and trusts a line only for a name so listed; a listed name the index
misses has its manifest read (the rules are the catalog's, ``Catalog._load_versions``). The index
saves parsing the manifests, not listing their names: S3 does not trust the lines without the
listing, since indexes written by older tiercache versions have no lines for the manifests they
deleted. A manifest deleted from a tier still gets a "gone" line there after it
(:func:`gone_line`); a reader drops a line whose manifest is not listed, or turns out to be gone
when it is read. A status line is written after its record: a crash in between leaves the line
before it, which a reader shows until the record changes again or ``doctor --reindex``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from tiercache.errors import InvalidNameError, StorageError
from tiercache.names import INDEX, check_name

if TYPE_CHECKING:
    from tiercache.manifest import Version
    from tiercache.tiers.base import Tier

log = logging.getLogger("tiercache.repo.index")

#: Lines per segment: a commit rewrites at most this many lines of its tier's index.
SEGMENT = 512
#: The index's line format (a reader skips lines of another format, and parses their manifests).
FORMAT = 1


@dataclass(slots=True, eq=False)
class Summary:
    """What the catalog knows of a version without its manifest.

    Attributes:
        id: The version id.
        parent: Its parent's id, or ``None``.
        branch: The branch it was saved on.
        step: Its training step.
        created_at: When ``save`` was called (UTC).
        nbytes: Total tensor bytes.
        meta: User metadata.
        ranks: How many ranks saved it (``0`` for a single-process version).
        is_header: Whether this is a multi-rank version known by its group manifest (which names
            no chunks: its parts do).
        chunks: The ids of the chunks its manifest names.
        dtypes: Tensor bytes per dtype (the policy's codec choice needs no tensor table).
    """

    id: str
    parent: str | None
    branch: str
    step: int
    created_at: datetime
    nbytes: int
    meta: dict[str, Any]
    ranks: int
    is_header: bool
    chunks: tuple[str, ...]
    dtypes: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, version: Version) -> Summary:
        """The summary of a manifest."""
        dtypes: dict[str, int] = {}
        table = version.tensors  # over its columns: no object per tensor
        for dtype, nbytes in zip(table.dtypes, table.nbytes.tolist(), strict=True):
            dtypes[dtype] = dtypes.get(dtype, 0) + nbytes
        return cls(version.id, version.parent, version.branch, version.step, version.created_at, version.nbytes,
                   dict(version.meta), version.ranks, version.is_header, tuple(c.id for c in version.chunks),
                   tuple(sorted(dtypes.items())))

    def to_line(self) -> dict[str, Any]:
        """The index line (as JSON-able data) of a stored manifest's summary."""
        # A multi-rank version is stored as its group manifest, which names no chunks (its parts do).
        header = self.ranks > 0
        return {"f": FORMAT, "id": self.id, "parent": self.parent, "branch": self.branch, "step": self.step,
                "at": self.created_at.isoformat(), "nbytes": self.nbytes, "meta": self.meta, "ranks": self.ranks,
                "chunks": [] if header else list(self.chunks),
                "dtypes": [] if header else [list(d) for d in self.dtypes]}

    @classmethod
    def from_line(cls, d: Mapping[str, Any]) -> Summary:
        """Parse an index line written by :meth:`to_line`.

        Raises:
            ValueError: If it is not one (a reader then parses the manifest instead).
        """
        # Thousands of lines are read per open: plain checks, no validation framework.
        try:
            vid, parent, branch = check_name(d["id"]), d["parent"], check_name(d["branch"])
            if parent is not None:
                check_name(parent)
            step, nbytes, ranks, meta = d["step"], d["nbytes"], d["ranks"], d["meta"]
            chunks = tuple(d["chunks"])
            dtypes = tuple((k, n) for k, n in d["dtypes"])
            at = datetime.fromisoformat(d["at"])
        except (KeyError, TypeError, ValueError, InvalidNameError) as e:
            raise ValueError(f"not an index line: {e}") from e
        if (d["f"] != FORMAT or type(step) is not int or type(nbytes) is not int or type(ranks) is not int
                or type(meta) is not dict or at.tzinfo is None
                or any(type(c) is not str for c in chunks)
                or any(type(k) is not str or type(n) is not int for k, n in dtypes)):
            raise ValueError("not an index line: wrong types")
        return cls(vid, parent, branch, step, at, nbytes, meta, ranks, ranks > 0, chunks, dtypes)


@dataclass
class Segments:
    """One tier's index of one kind as this process last read or wrote it.

    Attributes:
        last: The number of the last segment.
        lines: The last segment's lines.
        ids: The ids with a line in any segment.
    """

    last: int = 0
    lines: list[bytes] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)


def gone_line(vid: str) -> dict[str, Any]:
    """The line that says the manifest of ``vid`` left the tier (evicted, collected, pruned)."""
    return {"f": FORMAT, "id": vid, "gone": True}


def is_gone(d: Mapping[str, Any]) -> bool:
    """Whether an index line is a :func:`gone_line`."""
    return d.get("gone") is True


def _loads(line: bytes) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


def _key(kind: str, n: int) -> str:
    return f"{INDEX}{kind}/{n:08d}.jsonl"


def read(tier: Tier, kind: str) -> tuple[dict[str, dict[str, Any]], Segments, int]:
    """Read tier ``tier``'s index of ``kind`` (``versions``, ``pruned`` or ``status``).

    Of an id with several lines (a status record rewritten, a version gone), the last one counts.

    Returns:
        The lines by id (damaged lines left out; gone lines in), where the index ends (to append
        to it), and how many lines were damaged.

    Raises:
        StorageError: If the tier fails.
    """
    keys = sorted(k for k in tier.list(f"{INDEX}{kind}/") if k.endswith(".jsonl"))
    numbered = []
    for k in keys:
        try:
            numbered.append((int(k.rsplit("/", 1)[-1][: -len(".jsonl")]), k))
        except ValueError:
            continue
    if len(numbered) > 4:  # a few reads cost less than starting threads
        with ThreadPoolExecutor(min(8, len(numbered))) as pool:
            bodies = list(pool.map(lambda nk: tier.get(nk[1]), numbered))
    else:
        bodies = [tier.get(k) for _, k in numbered]
    out: dict[str, dict[str, Any]] = {}
    seg = Segments()
    bad = 0
    for (n, _), body in zip(numbered, bodies, strict=True):
        lines = [line if line.endswith(b"\n") else line + b"\n" for line in (body or b"").splitlines(keepends=True)]
        try:  # one parse for the whole segment (a line at a time only if some line is damaged)
            parsed = json.loads(b"[" + b",".join(lines) + b"]") if lines else []
        except ValueError:
            parsed = [_loads(line) for line in lines]
        good = []
        for line, d in zip(lines, parsed, strict=True):
            try:
                vid = check_name(d["id"])
            except (TypeError, KeyError, InvalidNameError):
                bad += 1  # a torn or damaged line: its manifest is parsed instead
                continue
            out[vid] = d
            good.append(line)
        seg.last, seg.lines = n, good
    seg.ids = {vid for vid, d in out.items() if not is_gone(d)}
    return out, seg, bad


def append(tier: Tier, kind: str, seg: Segments, lines: Iterable[tuple[str, dict[str, Any]]], *,
           again: bool = False) -> None:
    """Add lines to the end of the index (rewriting only its last segment, or starting new ones).

    ``seg`` is updated to what the tier holds now. A line of an id the index has is left out,
    unless ``again`` (a record that changed: the last line of an id is the one read) or it is a
    :func:`gone_line`.

    Raises:
        StorageError: If the tier fails (the lines not written are not in ``seg``).
    """
    todo = [(vid, json.dumps(d, separators=(",", ":")).encode() + b"\n", is_gone(d)) for vid, d in lines
            if again or is_gone(d) or vid not in seg.ids]
    while todo:
        if len(seg.lines) >= SEGMENT:
            seg.last, seg.lines = seg.last + 1, []
        room = SEGMENT - len(seg.lines)
        batch, todo = todo[:room], todo[room:]
        body = seg.lines + [line for _, line, _ in batch]
        # A cache of the manifests: the name need not be durable now (a reader repairs a lost line).
        tier.put(_key(kind, seg.last), b"".join(body), sync_name=False)
        seg.lines = body
        for vid, _, dead in batch:
            (seg.ids.discard if dead else seg.ids.add)(vid)


def rewrite(tier: Tier, kind: str, seg: Segments, lines: Iterable[tuple[str, dict[str, Any]]]) -> None:
    """Replace the whole index of ``kind`` on ``tier`` with ``lines`` (a rebuild; ``seg`` becomes it).

    Raises:
        StorageError: If the tier fails.
    """
    old = {k for k in tier.list(f"{INDEX}{kind}/") if k.endswith(".jsonl")}
    fresh = Segments(last=0)
    append(tier, kind, fresh, lines)
    for key in sorted(old - {_key(kind, n) for n in range(fresh.last + 1)}):
        tier.delete(key)
    seg.last, seg.lines, seg.ids = fresh.last, fresh.lines, fresh.ids


def try_append(tier: Tier, kind: str, seg: Segments, lines: Iterable[tuple[str, dict[str, Any]]], *,
               again: bool = False) -> None:
    """:func:`append`, logging a failure: the manifests are the truth and a reader repairs the index."""
    try:
        append(tier, kind, seg, lines, again=again)
    except StorageError as e:
        log.warning("could not update the index on %s (a later reader rebuilds it from the manifests): %s",
                    tier.name, e)
