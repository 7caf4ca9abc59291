"""tiercache.testing, the helpers for users' tests: LocalS3 (and its shell runner) and ThrottledProxy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiercache
from tiercache.errors import InvalidNameError
from tiercache.testing import LocalS3, ThrottledProxy, check_bucket_name

BAD_NAME = ("invalid bucket name {!r}: use 3-63 lowercase letters, digits, dots or hyphens, starting and ending "
            "with a letter or digit (e.g. tiercache-test)")


@pytest.mark.parametrize("name", ["Bad_Bucket", "ab", "x" * 64, "-lead", "trail-", "two..dots", "192.168.0.1"])
def test_an_invalid_bucket_name_fails_at_once(name: str, tmp_path: Path) -> None:
    # Refused when the server is configured, before anything starts (it used to retry for 60 s).
    with pytest.raises(InvalidNameError) as info:
        LocalS3(bucket=name, weed=tmp_path / "never-run")
    assert str(info.value) == BAD_NAME.format(name)
    assert list(tmp_path.iterdir()) == []


def test_valid_bucket_names_pass() -> None:
    assert [check_bucket_name(n) for n in ("abc", "tiercache-test", "a.b-c1", "x" * 63)] == [
        "abc", "tiercache-test", "a.b-c1", "x" * 63]


def test_the_runner_refuses_a_bad_bucket_in_one_line() -> None:
    ran = subprocess.run([sys.executable, "-m", "tiercache.testing.locals3", "--bucket", "My_Bucket"],
                         capture_output=True, text=True, check=False)
    assert (ran.returncode, ran.stdout, ran.stderr) == (2, "", f"error: {BAD_NAME.format('My_Bucket')}\n")


def test_the_runner_refuses_a_dir_it_cannot_create_in_one_line(tmp_path: Path) -> None:
    taken = tmp_path / "a-file"
    taken.write_text("")
    ran = subprocess.run([sys.executable, "-m", "tiercache.testing.locals3", "--dir", str(taken / "server")],
                         capture_output=True, text=True, check=False)
    assert (ran.returncode, ran.stdout) == (1, "")
    assert ran.stderr == f"error: cannot create the server's parent directory {taken / 'server'}: Not a directory\n"


def test_the_runner_serves_a_cache_until_interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    server_dir = tmp_path / "new"  # missing: the runner creates it (a short path: sockets go in it)
    # Started with SIGINT ignored, as a shell starts a background job's commands (and this suite's,
    # when it runs as one): Ctrl-C must still stop the runner.
    runner = subprocess.Popen(
        ["sh", "-c", 'trap "" INT; exec "$0" "$@"', sys.executable, "-m", "tiercache.testing.locals3",
         "--bucket", "mine", "--prefix", "exp1", "--dir", str(server_dir)],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ),
    )
    try:
        assert runner.stdout is not None
        header = runner.stdout.readline()
        assert header.startswith("# local S3 server (SeaweedFS) at http://127.0.0.1:") and "bucket mine" in header
        exports = dict(runner.stdout.readline().removeprefix("export ").strip().split("=", 1) for _ in range(7))
        assert sorted(exports) == ["AWS_ACCESS_KEY_ID", "AWS_DEFAULT_REGION", "AWS_EC2_METADATA_DISABLED",
                                   "AWS_REGION", "AWS_SECRET_ACCESS_KEY", "TIERCACHE_S3__ENDPOINT_URL",
                                   "TIERCACHE_S3__URL"]
        assert exports["TIERCACHE_S3__URL"] == "s3://mine/exp1"
        for key, value in exports.items():
            monkeypatch.setenv(key, value)
        # The exported variables alone configure an S3-only cache.
        state = {"w": torch.arange(1000, dtype=torch.float32)}
        with tiercache.open(None) as cache:
            vid = cache.save(state, step=5).wait("remote")
        with tiercache.open(None) as cache:
            assert cache.resolve("main") == vid
            assert torch.equal(cache.restore("main")["w"], state["w"])
    finally:
        runner.send_signal(signal.SIGINT)
        code = _stopped(runner)
    assert code == 0
    assert list(server_dir.iterdir()) == []  # the server's data went with it


def _stopped(proc: subprocess.Popen[str]) -> int | None:
    """Wait for ``proc`` to exit; if it does not, stop it (and its server) anyway: ``None`` then."""
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the runner stops its server on SIGTERM, and removes its data
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()  # the server goes with it (PDEATHSIG)
            proc.wait()
        return None


def test_throttled_proxy_refuses_a_target_beyond_loopback() -> None:
    with pytest.raises(ValueError, match="not on loopback"):
        ThrottledProxy(("192.0.2.1", 80))


def test_the_local_s3_server_starts_under_a_deep_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its unix sockets would not fit under a path this long (107 bytes at most).
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    with LocalS3(bucket="deep", root=deep) as s3:
        for k, v in s3.env().items():
            monkeypatch.setenv(k, v)
        cfg = {"s3": {"url": s3.url("run"), "endpoint_url": s3.endpoint_url}}
        with tiercache.open(cfg) as cache:
            vid = cache.save({"w": torch.arange(8.0)}, step=1).wait("remote")
            assert torch.equal(cache.restore(vid)["w"], torch.arange(8.0))
