"""tiercache ui's server: the JSON endpoints over a real cache, captures, assets, and who may ask."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import uvicorn
from _ui import stop, ui_process  # helpers next to the tests

import tiercache
from tiercache.config import load_config
from tiercache.ui.server import STATIC, Source, bind, create_app, is_loopback


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """Run ``app`` on a free loopback port in a thread; yields its base URL."""
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the server did not start"
            threading.Event().wait(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


TOKEN = "t0ken-for-the-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """GET ``url`` with the test token (``headers`` replace it: pass ``{}`` for none)."""
    req = urllib.request.Request(url, headers=AUTH if headers is None else headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as res:
            return res.status, {k.lower(): v for k, v in res.headers.items()}, res.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


@pytest.fixture
def cache_cfg(tmp_path: Path) -> tuple[Any, list[str]]:
    cfg = load_config({"disk": {"path": str(tmp_path / "cache")}}, env={})
    with tiercache.open(cfg) as cache:
        ids = [cache.save({"w": torch.full((256,), float(s))}, step=s).wait("local") for s in (10, 20)]
        cache.tag("first", ids[0])
    return cfg, ids


def test_endpoints_serve_the_views_of_the_cache(cache_cfg: tuple[Any, list[str]]) -> None:
    cfg, ids = cache_cfg
    with serving(create_app(Source(cfg, refresh=60.0, mttf=3600.0), token=TOKEN)) as url:
        status, headers, body = get(f"{url}/api/overview")
        assert status == 200 and headers["content-type"] == "application/json"
        assert "default-src 'self'" in headers["content-security-policy"]
        assert headers["referrer-policy"] == "no-referrer"
        ov = json.loads(body)
        assert (ov["tiers"], ov["levels"], ov["versions"], ov["branches"], ov["tags"]) == (
            ["disk"], ["staged", "local", "durable"], 2, 1, 1)
        assert ov["trainer"]["closed"] is True and ov["refresh_s"] == 60.0
        lin = json.loads(get(f"{url}/api/lineage")[2])
        assert [v["id"] for v in lin["versions"]] == ids[::-1]
        assert lin["versions"][1]["refs"] == ["tag/first"]
        summary = json.loads(get(f"{url}/api/version/{ids[1]}")[2])
        assert (summary["id"], summary["step"], summary["parent"], summary["nbytes"]) == (ids[1], 20, ids[0], 1024)
        assert get(f"{url}/api/version/01NOSUCHVERSION")[0] == 404
        lag = json.loads(get(f"{url}/api/lag")[2])
        assert lag["branches"]["main"]["levels"]["local"]["version"] == ids[1]
        assert lag["branches"]["main"]["levels"]["local"]["steps"] == 0
        th = json.loads(get(f"{url}/api/throughput")[2])
        # Two saves, each a bulk write and a commit (the meter fits latency from the commits).
        assert th["source"] == "status" and th["rates"]["disk"]["write"]["transfers"] == 4
        adv = json.loads(get(f"{url}/api/advice")[2])
        assert adv["source"] == "measured" and adv["plan"]["inputs"]["mttf"]["seconds"] == 3600.0
        st = json.loads(get(f"{url}/api/status")[2])
        assert list(st["status"]["versions"]) == ids
        page = get(f"{url}/")
        assert page[0] == 200 and b'<script src="/static/app.js">' in page[2]
        for name in ("app.js", "app.css"):
            assert get(f"{url}/static/{name}")[2] == (STATIC / name).read_bytes()
        # A page of another site cannot reach the server through DNS rebinding.
        refused = get(f"{url}/api/overview", {**AUTH, "Host": "attacker.example:80"})
        assert refused[0] == 403 and json.loads(refused[2]) == {
            "error": "this server answers only requests to a loopback host name"}
        # Another user of the node, on loopback, without the token: no data.
        for path in ("/", "/api/overview", "/api/lineage", "/api/status", "/static/app.js"):
            status, _, body = get(url + path, {})
            assert status == 401 and json.loads(body) == {
                "error": "a token is required: open the URL tiercache ui printed"}, path


def test_assets_load_nothing_from_elsewhere() -> None:
    names = sorted(p.name for p in STATIC.iterdir())
    assert names == ["app.css", "app.js", "index.html"]
    for path in STATIC.iterdir():
        text = path.read_text()
        # The only absolute URL is the SVG namespace name, which is never fetched.
        assert re.findall(r"https?://[^\s\"'`)]+", text) in ([], ["http://www.w3.org/2000/svg"]), path.name
        assert "<script>" not in text and "onclick=" not in text  # no inline script: the CSP forbids it


def test_source_takes_a_new_capture_only_after_refresh(cache_cfg: tuple[Any, list[str]]) -> None:
    cfg, _ = cache_cfg
    opened: list[object] = []
    now = [1000.0]

    def opener(config: Any) -> tiercache.TierCache:
        cache = tiercache.open(config)
        opened.append(cache)
        return cache

    source = Source(cfg, refresh=2.0, mttf=None, opener=opener, clock=lambda: now[0])
    first = source.capture()
    now[0] += 1.9
    assert source.capture() is first and len(opened) == 1
    now[0] += 0.1
    assert source.capture() is not first and len(opened) == 2
    assert all(c.closed for c in opened)


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("no-such-host.invalid")


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"])
def test_the_ui_requires_the_printed_token(tmp_path: Path, cache_cfg: tuple[Any, list[str]], host: str) -> None:
    cfg_file = tmp_path / "tiercache.toml"
    cfg_file.write_text(f'[disk]\npath = "{tmp_path / "cache"}"\n')
    proc, url = ui_process(cfg_file, "--host", host)
    try:
        m = re.fullmatch(rf"http://{re.escape(host)}:(\d+)/\?token=([A-Za-z0-9_-]{{32}})", url)
        assert m, url
        base, token = f"http://127.0.0.1:{m.group(1)}", m.group(2)
        for path in ("/", "/api/overview", "/api/lineage", "/api/status", "/static/app.js"):
            status, _, body = get(base + path, {})  # over loopback, but without the token
            assert status == 401, path
            assert json.loads(body) == {"error": "a token is required: open the URL tiercache ui printed"}
        assert get(f"{base}/api/overview?token={'x' * 32}", {})[0] == 401
        assert get(f"{base}/api/overview", {"Authorization": "Bearer nope"})[0] == 401
        status, _, body = get(f"{base}/api/overview", {"Authorization": f"Bearer {token}"})
        assert status == 200 and json.loads(body)["versions"] == 2
        # Opening the printed URL sets a cookie, which then carries the page's own requests.
        status, headers, _ = get(f"{base}/?token={token}", {})
        assert status == 200
        assert headers["set-cookie"] == f"tiercache_token={token}; Path=/; HttpOnly; SameSite=Strict"
        assert get(f"{base}/api/lag", {"Cookie": f"tiercache_token={token}"})[0] == 200
    finally:
        stop(proc)
    assert proc.returncode == 0


def test_ui_bad_input_is_one_line(tmp_path: Path) -> None:
    cfg_file = tmp_path / "tiercache.toml"
    cfg_file.write_text(f'[disk]\npath = "{tmp_path / "cache"}"\n')
    res = subprocess.run([sys.executable, "-m", "tiercache", "--config", str(cfg_file), "ui", "--gpus", "4"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip() == "error: --gpu-mtbf and --gpus go together: the job fails every MTBF / GPUs on average"


def test_import_tiercache_leaves_the_ui_stack_out() -> None:
    code = "import sys, tiercache; print(sorted(m for m in ('starlette', 'uvicorn') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stderr
