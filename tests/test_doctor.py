"""``doctor``: conditional-write probe and stale multipart uploads, on the real local S3 server.

A store that ignores conditional writes is simulated on the same real server by stripping the
``If-None-Match``/``If-Match`` headers from every request before it is signed (botocore
``before-sign`` hook): the server then sees, and performs, plain unconditional writes.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import tiercache
from tiercache.cache import core_of
from tiercache.cli import app
from tiercache.config import S3Config
from tiercache.errors import ConfigError, StorageError
from tiercache.tiers.s3 import S3Tier

pytestmark = pytest.mark.s3


def _strip_conditions(request: Any, **_: Any) -> None:
    for header in ("If-None-Match", "If-Match"):
        if header in request.headers:
            del request.headers[header]


@pytest.fixture
def ignores_conditions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every S3 client made from now on talks to a store that ignores conditional headers."""
    real = S3Tier._make_client

    def make(self: S3Tier, *args: Any, **kwargs: Any) -> Any:
        client = real(self, *args, **kwargs)
        client.meta.events.register_first("before-sign.s3", _strip_conditions)
        return client

    monkeypatch.setattr(S3Tier, "_make_client", make)


def _toml(tmp_path: Path, s3_config: S3Config, **s3: object) -> Path:
    fields = {"url": s3_config.url, "endpoint_url": s3_config.endpoint_url, "region": s3_config.region, **s3}
    lines = ["[s3]"] + [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    path = tmp_path / "tiercache.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_real_server_enforces_conditional_writes(s3_config: S3Config) -> None:
    with tiercache.open({"s3": s3_config.model_dump()}) as cache:
        unknown = cache.doctor()  # nobody saved yet, and plain doctor writes nothing: nothing probed
        assert unknown.probe == {} and unknown.probed_at is None and not unknown.ok
        assert "never probed" in unknown.problems[0] and "tiercache doctor --probe" in unknown.problems[0]
        report = cache.doctor(probe=True)
    assert report.probe == {"if_none_match": True, "if_match": True, "delete_if_match": report.probe["delete_if_match"],
                            "read_after_write": True}
    assert report.conditional_writes and report.ok and report.problems == []
    assert report.uploads == ()


def test_doctor_reports_the_probe_a_saving_process_recorded(s3_config: S3Config) -> None:
    with tiercache.open({"s3": s3_config.model_dump()}) as trainer:
        trainer.save({"w": torch.ones(4)}, step=1).wait("remote")  # probes before its first ref write
    with tiercache.open({"s3": s3_config.model_dump()}) as viewer:
        report = viewer.doctor()
    assert report.probed_at is not None and report.ok and report.probe["if_match"] is True


def test_abort_stale_refuses_a_store_whose_upload_times_are_fixed(
    s3_config: S3Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = S3Tier.list_multipart_uploads

    def fixed_dates(tier: S3Tier) -> list[tuple[str, str, datetime]]:
        return [(k, u, datetime(2010, 1, 1, tzinfo=UTC)) for k, u, _ in real(tier)]  # an emulator's fixed date

    with tiercache.open({"s3": s3_config.model_dump()}) as cache:
        tier = core_of(cache).repo.durable["s3"]
        upload = tier._client.create_multipart_upload(Bucket=s3_config.bucket, Key=f"{s3_config.prefix}/chunks/x")
        monkeypatch.setattr(S3Tier, "list_multipart_uploads", fixed_dates)
        with pytest.raises(StorageError, match=r"refusing to abort uploads by age: the store reports upload start "
                                               r"times -\d+ s off this clock"):
            cache.doctor(abort_stale=3600)
        monkeypatch.undo()
        assert [u for _, u, _ in tier.list_multipart_uploads()] == [upload["UploadId"]]  # nothing aborted


def test_doctor_lists_and_aborts_stale_multipart_uploads(s3_config: S3Config) -> None:
    with tiercache.open({"s3": s3_config.model_dump()}) as cache:
        tier = core_of(cache).repo.durable["s3"]
        client, bucket, prefix = tier._client, s3_config.bucket, s3_config.prefix
        ids = [client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/chunks/ab/ab{i:030d}")["UploadId"]
               for i in range(2)]
        listed = cache.doctor()
        assert sorted(u.upload_id for u in listed.uploads) == sorted(ids)
        assert not any(u.aborted for u in listed.uploads)
        assert any("unfinished multipart upload" in p for p in listed.problems)
        young = cache.doctor(abort_stale=3600)  # started seconds ago: not stale yet
        assert not any(u.aborted for u in young.uploads) and len(tier.list_multipart_uploads()) == 2
        aborted = cache.doctor(abort_stale=0)
        assert sorted(u.upload_id for u in aborted.uploads if u.aborted) == sorted(ids)
        assert tier.list_multipart_uploads() == []
        assert cache.doctor().uploads == ()


@pytest.mark.usefixtures("ignores_conditions")
def test_store_ignoring_conditional_writes_is_refused_unless_unsafe(s3_config: S3Config) -> None:
    with tiercache.open({"s3": s3_config.model_dump()}) as cache:
        report = cache.doctor(probe=True)
        assert report.probe["if_none_match"] is False and report.probe["if_match"] is False
        assert not report.conditional_writes and not report.ok
        assert "ignores conditional writes" in report.problems[0]
        assert "s3.allow_unsafe_refs = true" in report.problems[0]
        assert cache.doctor(unsafe=True, probe=True).ok
    unsafe_cfg = {"s3": {**s3_config.model_dump(), "allow_unsafe_refs": True}}
    with tiercache.open(unsafe_cfg) as cache:
        report = cache.doctor(probe=True)
        assert report.ok and not report.conditional_writes


def test_doctor_without_s3_is_a_config_error(tmp_path: Path) -> None:
    with tiercache.open({"disk": {"path": str(tmp_path)}}) as cache, pytest.raises(ConfigError, match=r"\[s3\]"):
        cache.doctor()


def test_cli_doctor_ok_on_the_real_server(tmp_path: Path, s3_config: S3Config) -> None:
    cfg = _toml(tmp_path, s3_config)
    result = CliRunner().invoke(app, ["--config", str(cfg), "doctor", "--probe"])
    assert result.exit_code == 0, result.output
    assert "ok   if_none_match" in result.output and "doctor: OK" in result.output
    as_json = CliRunner().invoke(app, ["--config", str(cfg), "doctor", "--probe", "--json"])
    assert json.loads(as_json.stdout)["conditional_writes"] is True


@pytest.mark.usefixtures("ignores_conditions")
def test_cli_doctor_refuses_a_store_ignoring_conditions(tmp_path: Path, s3_config: S3Config) -> None:
    cfg = _toml(tmp_path, s3_config)
    result = CliRunner().invoke(app, ["--config", str(cfg), "doctor", "--probe"])
    assert result.exit_code == 1
    assert "FAIL if_none_match" in result.output and "remote ref commits are refused" in result.output
    assert CliRunner().invoke(app, ["--config", str(cfg), "doctor", "--probe", "--unsafe"]).exit_code == 0
    unsafe = _toml(tmp_path, s3_config, allow_unsafe_refs=True)
    assert CliRunner().invoke(app, ["--config", str(unsafe), "doctor", "--probe"]).exit_code == 0


def test_cli_doctor_bad_age_is_bad_input(tmp_path: Path, s3_config: S3Config) -> None:
    result = CliRunner().invoke(app, ["--config", str(_toml(tmp_path, s3_config)), "doctor", "--abort-stale", "-5"])
    assert result.exit_code == 2
    assert "--abort-stale must be >= 0" in result.output


@pytest.mark.usefixtures("ignores_conditions")
def test_remote_ref_commits_are_refused_on_such_a_store_unless_unsafe(s3_config: S3Config) -> None:
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    cache = tiercache.open({"s3": s3_config.model_dump()})
    h = cache.save(state, step=1)
    with pytest.raises(ConfigError, match="ignores conditional writes") as refused:
        h.wait("remote")
    assert "s3.allow_unsafe_refs = true" in str(refused.value)
    with pytest.raises(ConfigError):
        cache.close()  # the background failure is reported once more on close
    assert core_of(cache).repo.durable["s3"].list("refs/") == []
    with tiercache.open({"s3": {**s3_config.model_dump(), "allow_unsafe_refs": True}}) as unsafe:
        h2 = unsafe.save(state, step=2)
        assert h2.wait("remote") == h2.version
        assert unsafe.refs() == {"branch/main": h2.version}
        assert torch.equal(unsafe.restore("main")["w"], state["w"])
