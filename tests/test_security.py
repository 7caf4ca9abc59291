"""Security: file modes, paths kept under the root, hostile manifests, pickle opt-in, secrets, TLS."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import tiercache
from tiercache.agent import naming
from tiercache.agent.arena import sweep
from tiercache.agent.client import AgentLink, connect
from tiercache.cli import app
from tiercache.config import DiskConfig, S3Config, load_config
from tiercache.errors import (
    ConfigError,
    IntegrityError,
    InvalidArgumentError,
    InvalidNameError,
    TierCacheError,
    TierFullError,
    UnsupportedStateError,
    VersionNotFoundError,
)
from tiercache.manifest import RefRecord, Version
from tiercache.tiers.disk import DiskTier

sys.path.insert(0, str(Path(__file__).parent))
from _agent import AgentProcess, agent_config, shm_place, short_dir  # helpers next to the tests

FAKE_SECRET = "tcFAKEsecret0123456789abcdefGHIJKLmnopQR"  # planted, then looked for in every output


def _save_one(root: Path) -> tuple[str, dict]:
    state = {"w": torch.arange(10, dtype=torch.float32), "n": 3}
    with tiercache.open({"disk": {"path": str(root)}}) as cache:
        vid = cache.save(state, step=1).wait("local")
        cache.tag("best", vid)
    return vid, state


def test_local_files_are_0600_and_directories_0700(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    _save_one(root)
    entries = [root, *root.rglob("*")]
    files = [p for p in entries if p.is_file()]
    dirs = [p for p in entries if p.is_dir()]
    assert files and len(dirs) > 3
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {"0o600"}
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in dirs} == {"0o700"}


@pytest.mark.parametrize(
    "key",
    ["../escape", "chunks/../../escape", "/etc/passwd", "versions/.tmp-x", "refs//main", "a\\b", "a b", "", "x" * 129],
)
def test_keys_that_could_leave_the_root_are_refused_before_any_io(tmp_path: Path, key: str) -> None:
    tier = DiskTier(DiskConfig(path=tmp_path / "root"))
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(InvalidNameError):
        tier.put(key, b"x")
    with pytest.raises(InvalidNameError):
        tier.get(key)
    assert sorted(tmp_path.rglob("*")) == before


def test_a_symlink_out_of_the_root_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    tier = DiskTier(DiskConfig(path=root))
    root.mkdir()  # (the first write makes the root; here something is planted in it first)
    (root / "versions").symlink_to(outside)
    with pytest.raises(InvalidNameError, match="outside the disk tier root"):
        tier.put("versions/V1.json", b"{}")
    assert list(outside.iterdir()) == []


def _manifest(vid: str, **chunk: object) -> bytes:
    data = {
        "id": vid, "parent": None, "branch": "main", "step": 1, "created_at": "2024-01-01T00:00:00Z",
        "chunks": [{"id": "ab" * 16, "nbytes": 4, **chunk}], "tree": 0, "nbytes": 4,
        "tensors": [{"path": "w", "dtype": "float32", "shape": [1], "nbytes": 4,
                     "pieces": [{"chunk": 0, "chunk_offset": 0, "offset": 0, "nbytes": 4}]}],
    }
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    "chunk_id",
    ["../../../etc/passwd", "ab/../../cd" + "0" * 24, "AB" * 16, "ab" * 8, "zz" * 16, "ab" * 16 + "/x", "ab" * 65],
)
def test_a_manifest_naming_keys_outside_its_layout_is_refused(tmp_path: Path, chunk_id: str) -> None:
    assert Version.from_json(_manifest("V1"), source="ok").chunks[0].id == "ab" * 16
    with pytest.raises(IntegrityError, match="not a valid tiercache manifest"):
        Version.from_json(_manifest("V1", id=chunk_id))
    # Planted on disk, the catalog ignores it: nothing reads a key it names.
    root = tmp_path / "root"
    tier = DiskTier(DiskConfig(path=root))
    tier.put("versions/V1.json", _manifest("V1", id=chunk_id))
    with tiercache.open({"disk": {"path": str(root)}}) as cache:
        assert cache.versions() == []
        with pytest.raises(VersionNotFoundError):
            cache.restore("V1")


@pytest.mark.parametrize("bad", [{"version": "../x"}, {"name": "a/b"}, {"kind": "remote"}, {"seq": -1}])
def test_a_hostile_ref_record_is_refused(bad: dict) -> None:
    good = {"kind": "branch", "name": "main", "version": "V1", "seq": 0}
    assert RefRecord.from_json(json.dumps(good).encode()).version == "V1"
    with pytest.raises(IntegrityError, match="not a valid tiercache ref"):
        RefRecord.from_json(json.dumps({**good, **bad}).encode())


class _Opaque:
    def __init__(self, x: int) -> None:
        self.x = x


def test_pickle_is_refused_unless_opted_in_on_both_save_and_restore(tmp_path: Path) -> None:
    state = {"w": torch.ones(2), "obj": _Opaque(5)}
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache, pytest.raises(UnsupportedStateError):
        cache.save(state, step=1)
    with tiercache.open({"disk": {"path": str(tmp_path)}, "allow_pickle": True}) as cache:
        cache.save(state, step=1).wait("local")
        assert cache.restore("main")["obj"].x == 5
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache, pytest.raises(UnsupportedStateError):
        cache.restore("main")


def test_tls_verification_is_on_unless_turned_off() -> None:
    assert S3Config(url="s3://bucket/p").verify_tls is True
    assert load_config({"s3": {"url": "s3://bucket/p"}}).s3.verify_tls is True
    assert load_config({"s3": {"url": "s3://bucket/p", "verify_tls": False}}).s3.verify_tls is False


def test_a_planted_secret_never_reaches_logs_errors_or_cli_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKEFAKEFAKE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    seen: list[str] = []
    # In a config: as a field that does not exist, and inside an endpoint URL (port 9: nothing listens).
    bad_field = {"s3": {"url": "s3://bucket/p", "aws_secret_access_key": FAKE_SECRET}}
    in_url = {"s3": {"url": "s3://bucket/p", "endpoint_url": f"http://key:{FAKE_SECRET}@127.0.0.1:9",
                     "max_attempts": 1, "connect_timeout": 0.5}}
    for cfg in (bad_field, in_url):
        with pytest.raises(TierCacheError) as info:
            tiercache.open(cfg)
        seen += [str(info.value), repr(info.value), str(info.value.__cause__ or "")]
    toml = tmp_path / "tiercache.toml"
    toml.write_text(f'[s3]\nurl = "s3://bucket/p"\nendpoint_url = "http://key:{FAKE_SECRET}@127.0.0.1:9"\n'
                    'max_attempts = 1\nconnect_timeout = 0.5\n')
    runner = CliRunner()
    for args in (["--config", str(toml), "ls"], ["--config", str(toml), "restore", "main", "--out", "x.pt"]):
        result = runner.invoke(app, args)
        assert result.exit_code != 0
        seen.append(result.output)
    seen.append(caplog.text)
    assert all(FAKE_SECRET not in text for text in seen)
    assert any("127.0.0.1:9" in text for text in seen)  # the errors did name the endpoint


def test_an_unknown_config_field_is_refused_by_name_without_echoing_its_value() -> None:
    with pytest.raises(ConfigError, match="aws_secret_access_key") as info:
        load_config({"s3": {"url": "s3://b/p", "aws_secret_access_key": FAKE_SECRET}})
    assert FAKE_SECRET not in str(info.value)


def test_environment_of_this_process_is_untouched_by_open(tmp_path: Path) -> None:
    before = dict(os.environ)
    _save_one(tmp_path)
    assert dict(os.environ) == before


# ------------------------------------------------------------------------ other users of the node
# Tests run as root here: "another user" is a file or directory chown'ed to uid 1002, a symlink,
# or a mode others may write to, in the places another user could have made them first.

OTHER_UID = 1002
_REFUSED = ("remove it, or set XDG_RUNTIME_DIR or [agent] socket to a directory of your own (mode 0700); "
            "saving in this process")


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A stand-in for /tmp (the agent's default directory is ``<tmp>/tiercache-<uid>`` without XDG_RUNTIME_DIR)."""
    tmp = short_dir()
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    yield tmp
    shutil.rmtree(tmp)


def _agent_cfg(root: Path, shm: Path) -> dict[str, Any]:
    return {"ram": {"capacity": "8MiB"}, "disk": {"path": str(root / "disk")}, "pack_below": "4KiB",
            "agent": {"start": "auto", "shm_dir": str(shm), "idle_exit": 1}}


def _saves_in_process_with_one_warning(cfg: dict[str, Any], caplog: pytest.LogCaptureFixture) -> list[str]:
    """Save through a cache whose agent is refused: in process, bit-exact; return the warnings."""
    state = {"w": torch.randn(1000, generator=torch.Generator().manual_seed(3)), "i": torch.arange(7), "n": 5}
    with caplog.at_level(logging.WARNING, "tiercache"), tiercache.open(cfg) as cache:
        cache.save(state, step=1).wait("local")
        assert type(cache.engine.backend).__name__ == "Engine"
    with tiercache.open({k: v for k, v in cfg.items() if k != "agent"}) as cache:
        got = cache.restore("main")
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["i"], state["i"]) and got["n"] == 5
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("kind", ["mode 0777", "mode 0755", "another user's", "a symlink", "a file"])
def test_an_agent_directory_another_user_could_have_made_is_refused_and_saves_stay_in_process(
    tmp_path: Path, runtime: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    d = runtime / f"tiercache-{os.getuid()}"
    elsewhere = runtime / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if kind == "a symlink":
        d.symlink_to(elsewhere)
        why = "is a symlink"
    elif kind == "a file":
        d.write_text("")
        why = "is not a directory"
    else:
        d.mkdir()
        mode = {"mode 0777": 0o777, "mode 0755": 0o755}.get(kind, 0o700)
        d.chmod(mode)
        if kind == "another user's":
            os.chown(d, OTHER_UID, OTHER_UID)
            why = f"belongs to uid {OTHER_UID}, not this user ({os.getuid()})"
        else:
            why = f"has mode {mode:04o}, not 0700"
    with shm_place() as shm:
        warnings = _saves_in_process_with_one_warning(_agent_cfg(tmp_path, shm), caplog)
        assert list(shm.iterdir()) == []  # no agent started
    assert warnings == [f"no node agent: the agent's directory {d} {why}: {_REFUSED}"]
    # Nothing was written where the other user could read or swap it.
    assert list(elsewhere.iterdir()) == []
    if d.is_dir() and not d.is_symlink():
        assert list(d.iterdir()) == []


def test_a_symlink_at_the_agents_log_is_not_followed(
    tmp_path: Path, runtime: Path, caplog: pytest.LogCaptureFixture
) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's own file\n")
    with shm_place() as shm:
        cfg = _agent_cfg(tmp_path, shm)
        place = naming.place(load_config(cfg))
        place.socket.parent.mkdir(mode=0o700)
        place.log.symlink_to(precious)
        warnings = _saves_in_process_with_one_warning(cfg, caplog)
        assert list(shm.iterdir()) == []
    assert warnings == [f"no node agent: the agent's file {place.log} is a symlink: remove it; saving in this process"]
    assert precious.read_text() == "the user's own file\n"
    assert sorted(p.name for p in place.socket.parent.iterdir()) == [place.log.name]


def test_the_sweep_names_and_leaves_a_file_another_user_planted_and_arena_names_are_random(
    caplog: pytest.LogCaptureFixture
) -> None:
    uid = os.getuid()
    with shm_place() as shm:
        planted = shm / f"tiercache-{uid}-0000000000000000-00000000.arena"
        planted.write_bytes(b"")
        os.chown(planted, OTHER_UID, OTHER_UID)
        link = shm / f"tiercache-{uid}-1111111111111111-00000000.arena"
        link.symlink_to(planted)
        mine = shm / f"tiercache-{uid}-2222222222222222-00000000-0123456789abcdef.arena"  # another boot's
        mine.write_bytes(b"")
        with caplog.at_level(logging.WARNING, "tiercache"):
            assert sweep(shm) == [mine]
        assert planted.exists() and link.is_symlink()
        assert [r.getMessage() for r in caplog.records] == [
            f"left {planted} alone: named like an arena of uid {uid} but owned by uid {OTHER_UID}",
            f"left {link} alone: named like an arena of uid {uid} but not a regular file",
        ]
        place = naming.AgentPlace(key="k" * 16, socket=Path("/nonexistent/a.sock"), shm_dir=shm)
        names = {place.arena().name for _ in range(3)}
    assert len(names) == 3
    assert all(re.fullmatch(rf"tiercache-{uid}-k{{16}}-[0-9a-f]+-[0-9a-f]{{16}}\.arena", n) for n in names), names


def test_sizes_from_a_client_are_checked_against_the_arena_first_and_the_agent_still_serves(
    tmp_path: Path
) -> None:
    sock = short_dir()
    try:
        with shm_place() as shm:
            cfg = agent_config(tmp_path, sock, shm_dir=str(shm))
            agent = AgentProcess(cfg, tmp_path / "agent.log")
            try:
                config = load_config(cfg)
                place = naming.place(config)
                conn = connect(place, 5.0)
                assert conn is not None and config.agent is not None
                link = AgentLink(conn, place, config.agent)
                link.hello(place.key)
                tib4 = 4 << 40
                with pytest.raises(TierFullError) as full:  # a 4 TiB tensor
                    link.request("structure", sid="huge", metas=[["w", "uint8", [tib4], tib4]], items=[1],
                                 chunk_bytes=64 << 20)
                assert str(full.value) == (f"a version needs {tib4} bytes of RAM arena but ram.capacity is "
                                           f"{32 << 20}: raise ram.capacity")
                with pytest.raises(TierFullError, match=f"keeping these chunks needs {tib4} bytes of RAM arena"):
                    link.request("keep", chunks=[["ab" * 16, tib4]], hash_algo="xxh3-128")
                bad = {"chunk_bytes": ({"metas": [["w", "uint8", [8], 8]], "items": [1], "chunk_bytes": 1},
                                       f"chunk_bytes 1 is not a multiple of 4096 of at least {64 << 10}"),
                       "negative": ({"metas": [["w", "uint8", [-8], -8]], "items": [1], "chunk_bytes": 64 << 10},
                                    "a tensor's size and shape cannot be negative"),
                       "items": ({"metas": [["w", "uint8", [8], 8]], "items": [1 << 40], "chunk_bytes": 64 << 10},
                                 "an item size must be 1 to 16 bytes")}
                for sid, (fields, message) in bad.items():
                    with pytest.raises(InvalidArgumentError) as info:
                        link.request("structure", sid=sid, **fields)
                    assert str(info.value) == message
                for part, world in [(0, 1 << 40), (3, 2), (-1, 2), (0, "2"), (True, 2)]:  # checked before anything
                    with pytest.raises(InvalidArgumentError) as info:
                        link.request("publish", rid=1, sid="none", version={}, part=part, world=world)
                    assert str(info.value) == (f"publish: part {part!r} of world {world!r}: expected "
                                               f"0 <= part < world <= {1 << 20}")
                # A number JSON has no room for (NaN, 1e400) is a malformed frame: that client is dropped.
                raw = connect(place, 5.0)
                assert raw is not None
                frame = b'{"op":"flush","id":1,"within":NaN}'
                raw.sock.settimeout(60)
                raw.sock.sendall(struct.pack("<I", len(frame)) + frame)
                assert raw.recv() is None
                raw.close()
                assert link.request("stats")["pid"] == agent.pid  # the first client was never dropped
                link.close()
                # The agent still serves: a save through it, restored bit-exact.
                state = {"w": torch.randn(4096, generator=torch.Generator().manual_seed(5))}
                with tiercache.open(cfg) as cache:
                    cache.save(state, step=1).wait("local")
                    assert type(cache.engine.backend).__name__ == "AgentBackend"
                with tiercache.open(cfg) as cache:
                    assert torch.equal(cache.restore("main")["w"], state["w"])
            finally:
                assert agent.stop() == 0
    finally:
        shutil.rmtree(sock)


def _planted_config(where: Path, marker: Path, *, owner: int | None = None, mode: int = 0o644) -> Path:
    """A tiercache.toml whose policy would run a shell command (creating ``marker``) if it were ever called."""
    cfg = where / "tiercache.toml"
    cfg.write_text(f'[disk]\npath = "{where / "disk"}"\n[policy]\nname = "os:system"\n'
                   f'params = {{ command = "touch {marker}" }}\n')
    if owner is not None:
        os.chown(cfg, owner, owner)
    cfg.chmod(mode)
    return cfg


def _cli(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "tiercache", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})
    return proc.returncode, proc.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="planting a file as another uid needs root (chown)")
def test_a_config_another_user_planted_is_refused_and_its_policy_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    shared = tmp_path / "shared"
    shared.mkdir()
    cfg = _planted_config(shared, marker, owner=12345)
    refused = ("error: config file tiercache.toml is not used: it is owned by uid 12345, not by you (uid 0) or "
               "root (chown it, chmod go-w it, or pass the config you mean with --config)\n")
    for verb in (["stats"], ["gc", "--dry-run"], ["verify"], ["ls"]):
        code, err = _cli(verb, shared)
        assert code != 0 and err == refused, verb
    # Named by the environment: found by search as well.
    code, err = _cli(["stats"], tmp_path, {"TIERCACHE_CONFIG": str(cfg)})
    assert code != 0 and err == refused.replace("file tiercache.toml", f"file {cfg}")
    # Named explicitly: read as data, but its module:Class policy is not imported.
    code, err = _cli(["--config", str(cfg), "stats"], tmp_path)
    assert code != 0 and err == (f"error: config file {cfg}: field 'policy.name': a package.module:Class policy is "
                                 "imported only from a config you own (it is owned by uid 12345, not by you (uid 0) "
                                 "or root): pass it with --policy, or own the file\n")
    cwd = os.getcwd()
    os.chdir(shared)
    try:
        with pytest.raises(ConfigError, match=r"^config file tiercache\.toml is not used: it is owned by uid 12345"):
            tiercache.open()
    finally:
        os.chdir(cwd)
    assert not marker.exists() and not (shared / "disk").exists()


def test_a_config_others_may_write_is_refused_and_a_policy_path_must_name_a_policy_class(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    shared = tmp_path / "shared"
    shared.mkdir()
    cfg = _planted_config(shared, marker, mode=0o666)
    code, err = _cli(["stats"], shared)
    assert code != 0 and err == ("error: config file tiercache.toml is not used: anyone may write it (chown it, "
                                 "chmod go-w it, or pass the config you mean with --config)\n")
    # Our own file: read, and the name is checked to be a policy class before anything is called.
    cfg.chmod(0o600)
    code, err = _cli(["stats"], shared)
    assert code != 0 and err == ("error: policy 'os:system' is not a policy class (a class with place(), evict() "
                                 "and on_full(): implement tiercache.Policy)\n")
    with pytest.raises(ConfigError, match=r"^policy 'os:system' is not a policy class"):
        tiercache.open({"disk": {"path": str(tmp_path / "d")}, "policy": {"name": "os:system",
                                                                         "params": {"command": f"touch {marker}"}}})
    assert not marker.exists()
