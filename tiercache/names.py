"""Validation of user-supplied names and of the storage keys built from them.

Branch and tag names, version ids and every segment of a storage key must match
``[A-Za-z0-9._-]{1,128}`` and must not start with a dot (so ``.``/``..`` and the tiers' own
``.tmp-*`` files can never be named). Keys are ``/``-separated segments; nothing else reaches a
tier, so a key can never escape a tier's root.
"""

from __future__ import annotations

import re

from tiercache.errors import InvalidNameError

_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_CHUNK_ID_RE = re.compile(r"[0-9a-f]{32,128}")

#: Key prefixes of the layout shared by every durable tier (docs/design.md section 2).
CHUNKS = "chunks/"
VERSIONS = "versions/"
REFS = "refs/"
#: Why a version is not on some tier (skipped, failed, evicted), kept next to its manifest.
STATUS = "status/"
#: Branch and tag moves that left a version behind (rollback, resume, branch, tag).
REFLOG = "reflog/"
#: The ranks' part manifests of multi-rank versions (see :mod:`tiercache.parts`).
PARTS = "parts/"
#: Versions a user-set rule deleted from their last durable tier (which rule, when, their lineage).
PRUNED = "pruned/"
#: The catalog's index: one line per manifest or pruned record, so listing reads no manifest.
INDEX = "index/"


def check_name(name: object, what: str = "name") -> str:
    """Return ``name`` if it is a valid branch, tag or version name.

    Args:
        name: The candidate name.
        what: What the name is for, used in the error message (``"branch"``, ``"tag"``...).

    Returns:
        The name, unchanged.

    Raises:
        InvalidNameError: If the name is not a string matching ``[A-Za-z0-9._-]{1,128}`` or
            starts with a dot.
    """
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise InvalidNameError(
            f"invalid {what} {name!r}: use 1-128 characters from A-Z a-z 0-9 . _ - "
            "(no '/', no '..', not starting with '.')"
        )
    return name


def check_key(key: object) -> str:
    """Return ``key`` if every ``/``-separated segment of it is a valid name.

    Raises:
        InvalidNameError: If any segment is empty, too long, starts with a dot or has a
            character outside ``[A-Za-z0-9._-]``.
    """
    if not isinstance(key, str) or not key:
        raise InvalidNameError(f"invalid storage key {key!r}")
    for part in key.split("/"):
        if _NAME_RE.fullmatch(part) is None:
            raise InvalidNameError(f"invalid storage key {key!r}: bad segment {part!r}")
    return key


def check_chunk_id(chunk_id: object) -> str:
    """Return ``chunk_id`` if it is a lowercase hex content id.

    Raises:
        InvalidNameError: If the id is not 32-128 lowercase hex digits.
    """
    if not isinstance(chunk_id, str) or _CHUNK_ID_RE.fullmatch(chunk_id) is None:
        raise InvalidNameError(f"invalid chunk id {chunk_id!r}: expected lowercase hex")
    return chunk_id


def chunk_key(chunk_id: str) -> str:
    """Storage key of a chunk: ``chunks/<id[:2]>/<id>``."""
    check_chunk_id(chunk_id)
    return f"{CHUNKS}{chunk_id[:2]}/{chunk_id}"


def version_key(version_id: str) -> str:
    """Storage key of a version manifest: ``versions/<id>.json``."""
    check_name(version_id, "version id")
    return f"{VERSIONS}{version_id}.json"


def part_key(version_id: str, rank: int) -> str:
    """Storage key of rank ``rank``'s part manifest of a multi-rank version: ``parts/<id>/<rank>.json``."""
    check_name(version_id, "version id")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise InvalidNameError(f"invalid rank {rank!r}: expected an int >= 0")
    return f"{PARTS}{version_id}/{rank}.json"


def ref_key(kind: str, name: str) -> str:
    """Storage key of a ref: ``refs/branch/<name>`` or ``refs/tag/<name>``."""
    if kind not in ("branch", "tag"):
        raise InvalidNameError(f"invalid ref kind {kind!r}: expected 'branch' or 'tag'")
    check_name(name, kind)
    return f"{REFS}{kind}/{name}"


def status_key(version_id: str) -> str:
    """Storage key of a version's outcome record: ``status/<id>.json``."""
    check_name(version_id, "version id")
    return f"{STATUS}{version_id}.json"


def pruned_key(version_id: str) -> str:
    """Storage key of a pruned version's record: ``pruned/<id>.json``."""
    check_name(version_id, "version id")
    return f"{PRUNED}{version_id}.json"


def reflog_key(kind: str, name: str, entry_id: str) -> str:
    """Storage key of one reflog entry: ``reflog/<kind>/<name>/<entry id>.json``."""
    ref_key(kind, name)
    check_name(entry_id, "reflog entry id")
    return f"{REFLOG}{kind}/{name}/{entry_id}.json"
