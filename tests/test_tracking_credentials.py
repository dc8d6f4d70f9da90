"""Tracking credentials go only to the server they came with (issue 38, docs/security.md).

The shell's MLFLOW_TRACKING_URI names server A with credentials (in the URI and/or in
MLFLOW_TRACKING_USERNAME / PASSWORD / TOKEN); a recipe or a spool naming server B must not get them.
Server B is a real HTTP listener on 127.0.0.1 that records every request's headers; A is another port.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import threading

import pytest
from mlflow.tracking import MlflowClient  # noqa: F401  its first import runs `uname -p`: at collection, not in a test

from run_helpers import free_port, mlp_recipe, trainkit
from trainkit.tracking.spool import Spool

USER, PASSWORD, TOKEN = "a-user-38", "a-pass-38x", "a-token-38y"
CREDENTIAL_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


class _Recorder(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.requests.append((self.command, self.path, dict(self.headers)))
        body = json.dumps({"error_code": "INTERNAL_ERROR", "message": "server B of the test"}).encode()
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def server_b():
    """An HTTP listener on 127.0.0.1 recording (method, path, headers) of each request; answers 500."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def _authorizations(server) -> list[str]:
    assert server.requests, "nothing reached the server: the test proves nothing"
    return [h[k] for _, _, h in server.requests for k in h if k.lower() == "authorization"]


def _shell_credentials_for(monkeypatch, origin: str) -> None:
    """The shell's MLflow credentials, all of them meant for `origin` (scheme://host:port)."""
    scheme, host = origin.split("://")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"{scheme}://{USER}:{PASSWORD}@{host}")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)


def _spool(run_dir, uri: str) -> None:
    Spool(run_dir).append([{"op": "create", "uri": uri, "experiment": "creds", "run_name": "r", "ts": 1, "tags": {}},
                           {"op": "metric", "key": "loss", "value": 1.0, "ts": 2, "step": 1},
                           {"op": "status", "status": "FINISHED", "ts": 3}])


@pytest.mark.slow
def test_sync_never_sends_the_shells_credentials_to_another_server(tmp_path, server_b):
    other = f"127.0.0.1:{free_port()}"  # server A: the origin the shell's credentials belong to
    _spool(tmp_path / "run", _url(server_b))
    result = trainkit(tmp_path, "sync", str(tmp_path / "run"), timeout=60,
                      MLFLOW_TRACKING_URI=f"http://{USER}:{PASSWORD}@{other}", MLFLOW_TRACKING_USERNAME=USER,
                      MLFLOW_TRACKING_PASSWORD=PASSWORD, MLFLOW_TRACKING_TOKEN=TOKEN)
    assert _authorizations(server_b) == []
    assert result.returncode == 1 and "still pending" in result.stderr, result.output  # B answered 500
    assert f"credentials belong to http://{other} and are not sent here" in result.stderr
    assert "Traceback" not in result.output and PASSWORD not in result.output and TOKEN not in result.output


def test_run_sends_the_shells_credentials_only_to_their_own_server(tmp_path, monkeypatch, server_b):
    """`trainkit run`'s launcher code path in-process (open_run: the run's creation, delivered before
    any worker starts), then the environment the workers inherit."""
    from trainkit.recipe import resolve
    from trainkit.tracking import run as tracking_run

    monkeypatch.setattr(tracking_run, "run_tags", lambda recipe, environment: {})  # no `git`, `uname` processes
    _shell_credentials_for(monkeypatch, f"http://127.0.0.1:{free_port()}")
    recipe = mlp_recipe(tmp_path, "elsewhere", tracking={"enabled": True, "uri": _url(server_b)})
    resolved = resolve(str(recipe), [])
    (tmp_path / "launch").mkdir()
    where = tracking_run.open_run(resolved, tmp_path / "run", tmp_path / "launch", {})
    assert "unreachable now" in where and "MLflow credentials belong to http://127.0.0.1:" in where
    assert _authorizations(server_b) == []
    for var in CREDENTIAL_VARS:  # what the workers inherit: nothing meant for A
        assert var not in os.environ, var
    assert PASSWORD not in os.environ["MLFLOW_TRACKING_URI"] and USER not in os.environ["MLFLOW_TRACKING_URI"]


def test_credentials_still_go_to_the_server_they_belong_to(tmp_path, monkeypatch, server_b):
    """The control: the same shell credentials, scoped to B's origin, are sent to B (token alone too),
    and a spool naming B after one naming A in the same process gets them back."""
    from trainkit.tracking.delivery import deliver

    _spool(tmp_path / "a", f"http://127.0.0.1:{free_port()}")
    _shell_credentials_for(monkeypatch, _url(server_b))
    deliver(tmp_path / "a")  # another origin first: what it strips must not stay stripped for B
    _spool(tmp_path / "b", _url(server_b) + "/")
    assert deliver(tmp_path / "b")[0] == 3
    basic = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    assert _authorizations(server_b) == [basic] * len(server_b.requests)
    server_b.requests.clear()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _url(server_b))  # a token alone, no user in the URI
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME")
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    deliver(tmp_path / "b")
    assert _authorizations(server_b) == [f"Bearer {TOKEN}"] * len(server_b.requests)


def test_validate_warns_when_the_recipes_server_is_not_the_credentials_server(tmp_path, monkeypatch, capsys):
    from trainkit.cli import main

    a = f"http://127.0.0.1:{free_port()}"
    _shell_credentials_for(monkeypatch, a)
    elsewhere = mlp_recipe(tmp_path, "elsewhere", tracking={"enabled": True, "uri": "http://127.0.0.1:9/"})
    assert main(["validate", str(elsewhere)]) == 0
    err = capsys.readouterr().err
    assert "warning: tracking.uri:" in err and "http://127.0.0.1:9" in err and a in err, err
    assert "not sent" in err and PASSWORD not in err and USER not in err
    same = mlp_recipe(tmp_path, "same", tracking={"enabled": True, "uri": a + "/"})
    assert main(["validate", str(same)]) == 0
    assert "warning" not in capsys.readouterr().err
