"""A headless Chromium driven over the DevTools protocol on a pipe: no driver, no extra package.

Chromium started with ``--remote-debugging-pipe`` reads DevTools commands from its fd 3 and writes
replies and events to its fd 4, each a JSON object followed by a NUL byte. This helper opens one
page, navigates, evaluates JavaScript, waits for a condition on the DOM and takes screenshots;
enough for the UI tests, nothing more.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

#: Flags that keep a headless Chromium from reaching any outside host (updates, sync, metrics...).
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions", "--metrics-recording-only", "--mute-audio",
    "--no-default-browser-check", "--hide-scrollbars", "--remote-debugging-pipe",
)


def chromium_path() -> str | None:
    """The Chromium binary (Debian's ``chromium``), or ``None`` where it is not installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class BrowserError(RuntimeError):
    """The browser answered a command with an error, or went away."""


class Browser:
    """One headless Chromium with one page.

    Args:
        width: Viewport width in CSS pixels.
        height: Viewport height.
    """

    def __init__(self, width: int = 1400, height: int = 1600) -> None:
        exe = chromium_path()
        if exe is None:
            raise BrowserError("chromium is not installed")
        self._profile = tempfile.mkdtemp(prefix="tiercache-chromium-")
        r, self._to_child = os.pipe()
        self._from_child, w = os.pipe()
        # The child's ends, moved to 10 and up so that putting them on 3 and 4 clobbers neither.
        child_r, child_w = fcntl.fcntl(r, fcntl.F_DUPFD, 10), fcntl.fcntl(w, fcntl.F_DUPFD, 10)
        os.close(r)
        os.close(w)
        args = [exe, *FLAGS, f"--user-data-dir={self._profile}", f"--window-size={width},{height}", "about:blank"]
        self._proc = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{child_r} 4>&{child_w} {child_r}<&- {child_w}>&-', "bash", *args],
            pass_fds=(child_r, child_w),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(child_r)
        os.close(child_w)
        self._buf = b""
        self._next = 0
        target = self._call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self._call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def _send(self, msg: dict[str, Any]) -> int:
        self._next += 1
        msg["id"] = self._next
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        return self._next

    def _recv(self) -> dict[str, Any]:
        while b"\0" not in self._buf:
            chunk = os.read(self._from_child, 1 << 16)
            if not chunk:
                raise BrowserError("chromium closed the DevTools pipe")
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        return json.loads(raw)

    def _call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        msg: dict[str, Any] = {"method": method, "params": params}
        if session is not None:
            msg["sessionId"] = session
        want = self._send(msg)
        while True:
            reply = self._recv()
            if reply.get("id") != want:
                continue  # an event: this helper polls the DOM instead of following events
            if "error" in reply:
                raise BrowserError(f"{method}: {reply['error']}")
            return reply.get("result", {})

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send a DevTools command to the page and return its result."""
        return self._call(method, self._session, **params)

    def goto(self, url: str) -> None:
        """Navigate and wait until the document has loaded."""
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def eval(self, expression: str) -> Any:
        """Evaluate a JavaScript expression in the page and return its (JSON) value."""
        got = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in got:
            raise BrowserError(f"{expression!r}: {got['exceptionDetails'].get('text')}")
        return got["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """Poll until ``expression`` is truthy in the page; return its value.

        Raises:
            BrowserError: If it is still falsy after ``timeout`` seconds (a failure, not a timing
                assertion: the page normally gets there in well under a second).
        """
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"still false after {timeout} s: {expression}")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> Path:
        """Save a PNG of the whole page."""
        height = int(self.eval("document.documentElement.scrollHeight"))
        width = int(self.eval("document.documentElement.scrollWidth"))
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        """Stop the browser and remove its profile."""
        with contextlib.suppress(BrowserError, OSError):  # already gone
            self._call("Browser.close")
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._to_child)
        os.close(self._from_child)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
