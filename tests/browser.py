"""A real browser for tests: headless Chromium driven over its DevTools pipe (no extra packages).

`--dump-dom --virtual-time-budget` snapshots a page at a moment chosen by virtual time, which for a
single-page app such as MLflow's UI came too early now and then (charts still loading). Over the
pipe a test opens a page and reads its text until what it waits for is there, with a real timeout.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

CHROMIUM = shutil.which("chromium")
CALL_TIMEOUT_S = 60.0


class Browser:
    """One headless Chromium with its own profile (so no remembered UI choices); `close()` ends it."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 1000):
        assert CHROMIUM, "this test needs Debian's chromium: apt-get install chromium (.ci/run installs it)"
        commands_r, self._commands = os.pipe()
        self._replies, replies_w = os.pipe()

        def on_fds_3_and_4():  # where --remote-debugging-pipe reads commands and writes replies
            a, b = os.dup(commands_r), os.dup(replies_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
             f"--window-size={width},{height}", "--remote-debugging-pipe", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=False, preexec_fn=on_fds_3_and_4,
            start_new_session=True)
        os.close(commands_r)
        os.close(replies_w)
        self._pending, self._last_id = b"", 0
        page = next(t for t in self._call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self._session = self._call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]

    def _call(self, method: str, session: str | None = None, **params) -> dict:
        self._last_id += 1
        message = {"id": self._last_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:  # replies and events, each ending with a NUL byte
            while b"\0" not in self._pending:
                if not select.select([self._replies], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    raise AssertionError(f"chromium did not answer {method} in {CALL_TIMEOUT_S:.0f} s")
                chunk = os.read(self._replies, 1 << 20)
                if not chunk:
                    raise AssertionError("chromium closed its DevTools pipe")
                self._pending += chunk
            raw, self._pending = self._pending.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._last_id:
                if "error" in reply:
                    raise AssertionError(f"chromium: {method}: {reply['error']}")
                return reply["result"]

    def _page(self, method: str, **params) -> dict:
        return self._call(method, session=self._session, **params)

    def text(self) -> str:
        """The page's text as a person sees it (`innerText`: one line per block)."""
        result = self._page("Runtime.evaluate", expression="document.body ? document.body.innerText : ''",
                            returnByValue=True)["result"]
        return result.get("value") or ""

    def open(self, url: str, ready: Callable[[str], bool], timeout: float = 60.0) -> str:
        """Load `url` afresh and return the page's text once `ready(text)` holds, or after `timeout`
        seconds (then the caller's assertion shows what was there). Through about:blank: going from one
        `#/...` route of a single-page app to another is a hash change the app may read half-way (MLflow's
        compare page once failed to parse its own query so), not the load a person's click on a link is."""
        self._page("Page.navigate", url="about:blank")
        self._page("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        text = self.text()
        while not ready(text) and time.monotonic() < deadline:
            time.sleep(0.3)
            text = self.text()
        return text

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self._page("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        os.close(self._commands)
        os.close(self._replies)
