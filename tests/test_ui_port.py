"""`trainkit ui` never prints a URL that another process serves (issue 38): a port in use is refused
before the server starts, and a server that exits before serving prints no URL."""

from __future__ import annotations

import http.server
import sys
import threading

import pytest

from run_helpers import trainkit

pytestmark = pytest.mark.slow


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"OK")

    def log_message(self, *args):
        pass


@pytest.fixture
def other_server():
    """Another process's server on 127.0.0.1: it answers every path, /health too."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_ui_on_a_port_another_server_serves_exits_with_a_message_and_no_url(tmp_path, other_server):
    result = trainkit(tmp_path, "ui", "--uri", f"sqlite:///{tmp_path}/m.db", "--port", str(other_server), timeout=60)
    assert result.returncode == 1, result.output
    assert f"port {other_server} on 127.0.0.1 is in use by another process; choose another with --port" \
        in result.stderr
    assert "http://" not in result.stdout and "Traceback" not in result.output


def test_a_ui_server_that_exits_before_serving_prints_no_url(other_server, capfd):
    """The port was free when checked, then taken: what answers on it is not this server."""
    from trainkit.tracking.ui_server import serve

    exits = [sys.executable, "-c", "import time; time.sleep(1.5); raise SystemExit(3)"]
    assert serve(exits, f"http://127.0.0.1:{other_server}/health", "MLflow UI for x: http://127.0.0.1") == 3
    out, err = capfd.readouterr()
    assert "http://" not in out and "MLflow UI exited (code 3) before serving" in err
