"""The catalog: every known version manifest, the refs, ref resolution and chunk residency.

It merges what the durable tiers hold (listing ``versions/`` and ``refs/`` on each) with what
this process has staged but not yet made durable. When tiers disagree about a ref, the record
with the highest ``seq`` wins: a ref is written to the fast tier first, and a rollback always
writes a higher ``seq`` than the move it undoes.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from tiercache.errors import AmbiguousRefError, ConflictError, IntegrityError, VersionNotFoundError
from tiercache.manifest import RefRecord, Version, parse_ref
from tiercache.names import CHUNKS, REFS, VERSIONS, check_name, ref_key, version_key
from tiercache.tiers.base import Tier

log = logging.getLogger("tiercache.catalog")

_MIN_PREFIX = 4


class Catalog:
    """Versions, refs and chunk residency across the tiers of one cache.

    Args:
        tiers: Every configured tier by name, fastest first (the RAM tier included).
    """

    def __init__(self, tiers: dict[str, Tier]) -> None:
        self._tiers = tiers
        self._durable = [n for n, t in tiers.items() if t.durable]
        self._lock = threading.RLock()
        self._versions: dict[str, Version] = {}
        self._on_tier: defaultdict[str, set[str]] = defaultdict(set)
        self._refs: dict[tuple[str, str], RefRecord] = {}
        self._chunks: dict[str, set[str]] = {}
        self._ref_locks: dict[tuple[str, str], threading.Lock] = {}
        self._tokens: dict[tuple[str, str], str] = {}
        self._loaded = False

    # ------------------------------------------------------------------ loading

    def load(self) -> None:
        """Read every manifest and ref from the durable tiers (once; later calls are no-ops)."""
        with self._lock:
            if self._loaded:
                return
            for name in self._durable:
                self._load_tier(name)
            self._loaded = True

    def _load_tier(self, name: str) -> None:
        tier = self._tiers[name]
        keys = tier.list(VERSIONS)
        ids = [k[len(VERSIONS) : -len(".json")] for k in keys if k.endswith(".json")]
        for vid in ids:
            self._on_tier[name].add(vid)
        missing = [vid for vid in ids if vid not in self._versions]

        def fetch(vid: str) -> Version | None:
            data = tier.get(version_key(vid))
            if data is None:
                return None
            try:
                v = Version.from_json(data, source=f"{name}:{version_key(vid)}")
            except IntegrityError as e:
                log.warning("ignoring damaged manifest: %s", e)
                return None
            if v.id != vid:
                log.warning("ignoring manifest %s on %s: it names version %s", vid, name, v.id)
                return None
            return v

        with ThreadPoolExecutor(8) as pool:
            for v in pool.map(fetch, missing):
                if v is not None:
                    self._versions[v.id] = v
        for key in tier.list(REFS):
            parts = key.split("/")
            if len(parts) != 3 or parts[1] not in ("branch", "tag"):
                continue
            got = tier.read_ref(key)
            if got is None:
                continue
            try:
                rec = RefRecord.from_json(got.data, source=f"{name}:{key}")
            except IntegrityError as e:
                log.warning("ignoring damaged ref: %s", e)
                continue
            self._tokens[(name, key)] = got.token
            cur = self._refs.get((rec.kind, rec.name))
            if cur is None or rec.seq > cur.seq:
                self._refs[(rec.kind, rec.name)] = rec

    # ------------------------------------------------------------------ versions

    def add(self, version: Version, tier: str | None = None) -> None:
        """Record a version this process created or copied (on ``tier``, if given)."""
        with self._lock:
            self._versions[version.id] = version
            if tier is not None:
                self._on_tier[tier].add(version.id)

    def mark_on(self, tier: str, version_id: str, present: bool = True) -> None:
        """Record that ``tier`` now holds (or no longer holds) the manifest of a version."""
        with self._lock:
            (self._on_tier[tier].add if present else self._on_tier[tier].discard)(version_id)

    def manifest_on(self, tier: str, version_id: str) -> bool:
        """Whether ``tier`` holds the manifest of ``version_id``."""
        with self._lock:
            return version_id in self._on_tier[tier]

    def get(self, version_id: str) -> Version:
        """Return a version's manifest.

        Raises:
            VersionNotFoundError: If no tier has it.
        """
        self.load()
        with self._lock:
            v = self._versions.get(version_id)
        if v is None:
            raise VersionNotFoundError(f"version {version_id} not found on any tier")
        return v

    def all(self) -> list[Version]:
        """Every known version, oldest first."""
        self.load()
        with self._lock:
            return sorted(self._versions.values(), key=lambda v: v.id)

    # ------------------------------------------------------------------ chunks

    def chunks_on(self, tier: str) -> set[str]:
        """Ids of the chunks ``tier`` holds (listed once, then kept up to date by the caller)."""
        with self._lock:
            got = self._chunks.get(tier)
            if got is None:
                keys = self._tiers[tier].list(CHUNKS)
                got = {k.rsplit("/", 1)[-1] for k in keys}
                self._chunks[tier] = got
            return got

    def note_chunks(self, tier: str, ids: Iterable[str], present: bool = True) -> None:
        """Record chunks written to (or removed from) ``tier``."""
        have = self.chunks_on(tier)
        with self._lock:
            if present:
                have.update(ids)
            else:
                have.difference_update(ids)

    def residency(self, version: Version) -> tuple[str, ...]:
        """Tiers that hold every chunk of ``version``, fastest first."""
        ids = {c.id for c in version.chunks}
        out = []
        for name in self._tiers:
            if not (self._tiers[name].durable or self._tiers[name].name == "ram"):
                continue
            if ids <= self.chunks_on(name) and (self.manifest_on(name, version.id) or not ids):
                out.append(name)
        return tuple(out)

    # ------------------------------------------------------------------ refs

    def refs(self) -> dict[str, RefRecord]:
        """Every ref as ``{"branch/main": record, "tag/best": record}``."""
        self.load()
        with self._lock:
            return {f"{k}/{n}": r for (k, n), r in sorted(self._refs.items())}

    def ref(self, kind: str, name: str) -> RefRecord | None:
        """The current record of one ref, or ``None``."""
        self.load()
        with self._lock:
            return self._refs.get((kind, name))

    def set_ref(self, record: RefRecord) -> None:
        """Record a ref move in this process's view (before or without a durable write)."""
        with self._lock:
            cur = self._refs.get((record.kind, record.name))
            if cur is None or record.seq >= cur.seq:
                self._refs[(record.kind, record.name)] = record

    def write_ref(self, tier: str, record: RefRecord, *, only_if_newer: bool) -> bool:
        """Write ``record`` to ``tier`` with compare-and-swap.

        Args:
            tier: A durable tier name.
            record: The new content.
            only_if_newer: Leave the ref alone (return False) if the tier already holds a record
                with a higher ``seq`` (a rollback overtook this move).

        Returns:
            Whether the ref was written.

        Raises:
            ConflictError: If another writer moved the ref (or the tag exists elsewhere).
        """
        key = ref_key(record.kind, record.name)
        lk = (tier, key)
        with self._lock:
            lock = self._ref_locks.setdefault(lk, threading.Lock())
        t = self._tiers[tier]
        with lock:
            token = self._tokens.get(lk)
            if token is None:
                got = t.read_ref(key)
                if got is not None:
                    cur = RefRecord.from_json(got.data, source=f"{tier}:{key}")
                    if cur == record:
                        self._tokens[lk] = got.token
                        return True
                    if record.kind == "tag":
                        raise ConflictError(f"tag {record.name!r} already points at {cur.version}")
                    if only_if_newer and cur.seq > record.seq:
                        return False
                    token = got.token
            try:
                self._tokens[lk] = t.write_ref(key, record.to_json(), expect=token)
            except ConflictError:
                self._tokens.pop(lk, None)
                got = t.read_ref(key)
                if got is not None:
                    cur = RefRecord.from_json(got.data, source=f"{tier}:{key}")
                    if cur == record:
                        self._tokens[lk] = got.token
                        return True
                    if only_if_newer and cur.seq > record.seq:
                        return False
                raise
            return True

    # ------------------------------------------------------------------ resolution

    def resolve(self, ref: str) -> str:
        """Resolve a user ref string to a version id.

        Forms: a branch name, a tag name, a version id or unique prefix (at least 4 characters),
        each optionally followed by ``~N`` (N parents back) or ``@STEP`` (the version of that
        step in the branch's history). Branches win over tags, tags over ids.

        Raises:
            InvalidNameError: If the string is malformed.
            VersionNotFoundError: If nothing matches.
            AmbiguousRefError: If an id prefix matches several versions.
        """
        spec = parse_ref(ref)
        self.load()
        with self._lock:
            rec = self._refs.get(("branch", spec.base)) or self._refs.get(("tag", spec.base))
            vid = rec.version if rec is not None else self._match_id(spec.base, ref)
            if spec.step is not None:
                return self._at_step(vid, spec.base, spec.step, ref)
            for i in range(spec.back):
                v = self._versions.get(vid)
                if v is None or v.parent is None:
                    raise VersionNotFoundError(f"{ref!r}: history of {spec.base!r} has only {i + 1} versions")
                vid = v.parent
            if vid not in self._versions:
                raise VersionNotFoundError(f"{ref!r} points at version {vid}, which no tier holds")
            return vid

    def _match_id(self, prefix: str, ref: str) -> str:
        if prefix in self._versions:
            return prefix
        hits = [v for v in self._versions if v.startswith(prefix.upper())] if len(prefix) >= _MIN_PREFIX else []
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise AmbiguousRefError(f"{ref!r} matches {len(hits)} versions: give more characters of the id")
        known = ", ".join(sorted(n for _, n in self._refs)[:8]) or "none yet"
        raise VersionNotFoundError(
            f"unknown ref {ref!r}: not a branch, tag or version id (refs: {known}); see `tiercache ls`"
        )

    def _at_step(self, head: str, base: str, step: int, ref: str) -> str:
        vid: str | None = head
        while vid is not None and vid in self._versions:
            v = self._versions[vid]
            if v.step == step:
                return vid
            vid = v.parent
        # Not in the current history (e.g. rolled back past it): the newest version of that
        # step saved on the branch.
        same = [v.id for v in self._versions.values() if v.branch == base and v.step == step]
        if same:
            return max(same)
        raise VersionNotFoundError(f"{ref!r}: no version of step {step} on {base!r}")

    @staticmethod
    def check_branch(name: str) -> str:
        """Validate a branch name."""
        return check_name(name, "branch")
