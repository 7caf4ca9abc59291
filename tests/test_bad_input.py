"""A corpus of bad manifests, refs and configs: each gets its typed one-line error; nothing else is touched.

Planted on a disk tier next to a good version, a bad manifest or ref is skipped with a warning:
the good version still lists and restores bit-exact, and a sentinel directory beside the cache
root is unchanged.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercache
from tiercache.config import load_config
from tiercache.errors import ConfigError, IntegrityError
from tiercache.manifest import RefRecord, Version, unseal

_PIECE = {"chunk": 0, "chunk_offset": 0, "offset": 0, "nbytes": 8}
GOOD_MANIFEST: dict[str, Any] = {
    "schema_version": 1, "id": "01BADBADBADBADBADBADBADBAD", "parent": None, "branch": "main", "step": 3,
    "created_at": "2024-01-01T00:00:00Z", "meta": {}, "hash_algo": "xxh3-128",
    "chunks": [{"id": "ab" * 16, "nbytes": 8}],
    "tensors": [{"path": "w", "dtype": "float32", "shape": [2], "nbytes": 8, "pieces": [_PIECE]}],
    "tree": {"w": 0}, "pickled": False, "nbytes": 8,
}


def _with(path: str, value: Any) -> bytes:
    """GOOD_MANIFEST with the field at dotted ``path`` replaced (``...`` deletes it)."""
    m = copy.deepcopy(GOOD_MANIFEST)
    *parents, last = path.split(".")
    node: Any = m
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    if value is ...:
        del node[last]
    elif last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return json.dumps(m).encode()


BAD_MANIFESTS: dict[str, bytes] = {
    "not json": b"{",
    "empty": b"",
    "null": b"null",
    "a list": b"[]",
    "binary": bytes(range(256)),
    "no id": _with("id", ...),
    "id escapes": _with("id", "../x"),
    "empty id": _with("id", ""),
    "parent escapes": _with("parent", "../../p"),
    "branch with slash": _with("branch", "a/b"),
    "step not int": _with("step", "x"),
    "bad date": _with("created_at", "yesterday"),
    "future schema": _with("schema_version", 3),
    "extra path field": _with("path", "/etc/passwd"),
    "unknown hash": _with("hash_algo", "md5"),
    "chunks not a list": _with("chunks", "x"),
    "chunk id escapes": _with("chunks.0.id", "../../etc/passwd"),
    "chunk id uppercase": _with("chunks.0.id", "AB" * 16),
    "chunk id short": _with("chunks.0.id", "ab"),
    "chunk nbytes negative": _with("chunks.0.nbytes", -1),
    "object dtype": _with("tensors.0.dtype", "object"),
    "negative shape": _with("tensors.0.shape", [-2]),
    "shape vs nbytes": _with("tensors.0.shape", [3]),
    "piece names missing chunk": _with("tensors.0.pieces.0.chunk", 5),
    "piece outside chunk": _with("tensors.0.pieces.0.chunk_offset", 100),
    "pieces cover too little": _with("tensors.0.pieces", []),
    "total nbytes": _with("nbytes", 999),
    "meta not a dict": _with("meta", [1]),
    "pickled not bool": _with("pickled", {"a": 1}),
}

# The same manifest as the current code writes it: the tensor table as columns.
GOOD_COLUMNS: dict[str, Any] = json.loads(unseal(Version.from_json(json.dumps(GOOD_MANIFEST).encode()).to_json(), ""))


def _columns_with(column: str, value: Any) -> bytes:
    m = copy.deepcopy(GOOD_COLUMNS)
    m["tensors"][column] = value
    return json.dumps(m).encode()


BAD_MANIFESTS.update({
    "columns: unknown layout": _columns_with("columns", 99),
    "columns: extra field": _columns_with("extra", 1),
    "columns: count vs paths": _columns_with("count", 2),
    "columns: short column": _columns_with("nbytes", "u1:"),
    "columns: not base64": _columns_with("chunk", "u1:!!"),
    "columns: unknown width": _columns_with("chunk", "x9:AA=="),
    "columns: dtype index": _columns_with("dtype", "u1:BQ=="),  # 5, of one name
    "columns: unknown dtype name": _columns_with("dtype_names", ["object"]),
    "columns: piece outside chunk": _columns_with("chunk_offset", "u1:ZA=="),  # 100
    "columns: shape vs nbytes": _columns_with("dims", "u1:Aw=="),  # [3]
    "columns: value out of range": _columns_with("offset", "u8:" + "/" * 10 + "8="),
})

GOOD_REF = {"schema_version": 1, "kind": "branch", "name": "main", "version": "01BADBADBADBADBADBADBADBAD", "seq": 0}
BAD_REFS: dict[str, bytes] = {
    "empty": b"",
    "not json": b"{",
    "a list": b"[1]",
    "kind": json.dumps({**GOOD_REF, "kind": "remote"}).encode(),
    "name escapes": json.dumps({**GOOD_REF, "name": "../x"}).encode(),
    "empty name": json.dumps({**GOOD_REF, "name": ""}).encode(),
    "version escapes": json.dumps({**GOOD_REF, "version": "../v"}).encode(),
    "version with slash": json.dumps({**GOOD_REF, "version": "a/b"}).encode(),
    "negative seq": json.dumps({**GOOD_REF, "seq": -1}).encode(),
    "seq not int": json.dumps({**GOOD_REF, "seq": "a"}).encode(),
    "no version": json.dumps({k: v for k, v in GOOD_REF.items() if k != "version"}).encode(),
    "extra field": json.dumps({**GOOD_REF, "path": "/etc"}).encode(),
    "future schema": json.dumps({**GOOD_REF, "schema_version": 2}).encode(),
}

BAD_CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "disk capacity": ({"disk": {"path": "/tmp/x", "capacity": "lots"}}, "disk.capacity"),
    "disk no path": ({"disk": {"capacity": "1GiB"}}, "disk.path"),
    "disk threads": ({"disk": {"path": "/tmp/x", "io_threads": 0}}, "disk.io_threads"),
    "disk o_direct": ({"disk": {"path": "/tmp/x", "o_direct": "maybe"}}, "disk.o_direct"),
    "disk not a table": ({"disk": "path"}, "disk"),
    "s3 http url": ({"s3": {"url": "http://x"}}, "s3.url"),
    "s3 no bucket": ({"s3": {"url": "s3://"}}, "s3.url"),
    "s3 part size": ({"s3": {"url": "s3://b", "part_size": -1}}, "s3.part_size"),
    "s3 attempts": ({"s3": {"url": "s3://b", "max_attempts": 0}}, "s3.max_attempts"),
    "s3 addressing": ({"s3": {"url": "s3://b", "addressing_style": "sideways"}}, "s3.addressing_style"),
    "s3 timeout": ({"s3": {"url": "s3://b", "connect_timeout": 0}}, "s3.connect_timeout"),
    "s3 tls": ({"s3": {"url": "s3://b", "verify_tls": "sometimes"}}, "s3.verify_tls"),
    "ram negative": ({"ram": {"capacity": "-5MiB"}}, "ram.capacity"),
    "ram bool": ({"ram": {"capacity": True}}, "ram.capacity"),
    "chunk small": ({"chunk_bytes": 1000}, "chunk_bytes"),
    "chunk garbage": ({"chunk_bytes": "64KiB1"}, "chunk_bytes"),
    "hash": ({"hash": "md5"}, "hash"),
    "schema": ({"schema_version": 2}, "schema_version"),
    "unknown field": ({"unknown": 1}, "unknown"),
    "policy not a table": ({"policy": "fast"}, "policy"),
    "io threads": ({"io_threads": 100}, "io_threads"),
    "gc grace": ({"gc_grace": -1}, "gc_grace"),
}


def _snapshot(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


@pytest.fixture
def cache_root(tmp_path: Path) -> tuple[Path, str]:
    """A cache root holding one good version on main, and a sentinel directory beside it."""
    root = tmp_path / "root"
    with tiercache.open({"disk": {"path": str(root)}}) as cache:
        vid = cache.save({"w": torch.arange(4.0)}, step=1).wait("local")
    (tmp_path / "sentinel").mkdir()
    (tmp_path / "sentinel" / "keep").write_text("x")
    return root, vid


def _still_good(root: Path, vid: str, caplog: pytest.LogCaptureFixture, sentinel: Path, before: dict) -> None:
    with caplog.at_level(logging.WARNING, logger="tiercache"), tiercache.open({"disk": {"path": str(root)}}) as c:
        assert [v.id for v in c.versions()] == [vid]
        assert c.resolve("main") == vid
        assert torch.equal(c.restore("main")["w"], torch.arange(4.0))
    assert "ignoring damaged" in caplog.text
    assert _snapshot(sentinel) == before


@pytest.mark.parametrize("name", list(BAD_MANIFESTS))
def test_bad_manifest_is_refused_with_integrity_error(
    name: str, cache_root: tuple[Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    assert Version.from_json(json.dumps(GOOD_MANIFEST).encode()).id == GOOD_MANIFEST["id"]
    with pytest.raises(IntegrityError, match="not a valid tiercache manifest") as info:
        Version.from_json(BAD_MANIFESTS[name], source="planted")
    assert "\n" not in str(info.value)
    root, vid = cache_root
    sentinel = root.parent / "sentinel"
    before = _snapshot(sentinel)
    (root / "versions" / "01BADBADBADBADBADBADBADBAD.json").write_bytes(BAD_MANIFESTS[name])
    _still_good(root, vid, caplog, sentinel, before)


@pytest.mark.parametrize("name", list(BAD_REFS))
def test_bad_ref_is_refused_with_integrity_error(
    name: str, cache_root: tuple[Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(IntegrityError, match="not a valid tiercache ref") as info:
        RefRecord.from_json(BAD_REFS[name], source="planted")
    assert "\n" not in str(info.value)
    root, vid = cache_root
    sentinel = root.parent / "sentinel"
    before = _snapshot(sentinel)
    (root / "refs" / "branch" / "other").write_bytes(BAD_REFS[name])
    _still_good(root, vid, caplog, sentinel, before)


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_gets_config_error_naming_the_field(name: str, tmp_path: Path) -> None:
    data, field = BAD_CONFIGS[name]
    with pytest.raises(ConfigError) as info:
        load_config(data, env={})
    msg = str(info.value)
    assert f"field '{field}'" in msg and "\n" not in msg
    assert list(tmp_path.iterdir()) == []  # nothing was created


def test_a_config_file_that_is_not_toml_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "c.toml"
    bad.write_text("[disk\n")
    with pytest.raises(ConfigError, match=r"c\.toml is not valid TOML"):
        load_config(bad, env={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml", env={})


def test_existing_and_missing_refs_raise_typed_errors_with_their_names(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache:
        v1 = cache.save({"w": torch.ones(2)}, step=1).wait("local")
        v2 = cache.save({"w": torch.zeros(2)}, step=2).wait("local")
        cache.tag("best", v1)
        with pytest.raises(tiercache.RefExistsError) as branch:
            cache.branch("main", v1)
        assert (branch.value.kind, branch.value.name, branch.value.version) == ("branch", "main", v2)
        assert isinstance(branch.value, tiercache.ConflictError)
        with pytest.raises(tiercache.RefExistsError) as tag:
            cache.tag("best", v2)
        assert (tag.value.kind, tag.value.name, tag.value.version) == ("tag", "best", v1)
        with pytest.raises(tiercache.BranchNotFoundError) as missing:
            cache.rollback("nope", v1)
        assert missing.value.branch == "nope" and isinstance(missing.value, LookupError)
        assert cache.refs() == {"branch/main": v2, "tag/best": v1}
