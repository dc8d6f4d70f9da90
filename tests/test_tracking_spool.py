"""The tracking spool delivers every record to MLflow once, in order, and keeps what it cannot send."""

import json
import socket
import time

from mlflow.tracking import MlflowClient

from trainkit.tracking.delivery import deliver
from trainkit.tracking.run import MAX_PARAM, flatten
from trainkit.tracking.spool import Spool


def test_flatten_gives_stable_dotted_keys_and_keeps_long_values_visible():
    flat = flatten({"trainer": {"checkpoint": {"every": 5}}, "monitors": [{"name": "system"}, {"name": "gpu"}],
                    "shape": [3, 32, 32], "tags": {}, "long": "x" * (MAX_PARAM + 10)})
    assert flat["trainer.checkpoint.every"] == "5"
    assert flat["monitors.1.name"] == "gpu"
    assert flat["shape"] == "[3, 32, 32]"
    assert flat["tags"] == "{}"
    assert len(flat["long"]) <= MAX_PARAM and flat["long"].endswith("[truncated: see recipe.yaml artifact]")


def _spool_run(run_dir, uri, points, key="loss"):
    spool = Spool(run_dir)
    spool.append([{"op": "create", "uri": uri, "experiment": "spool-test", "run_name": "r", "ts": 1,
                   "tags": {"strategy": "ddp"}},
                  {"op": "params", "params": {"a.b": "1"}}])
    spool.append([{"op": "metric", "key": key, "value": 1.0 / (s + 1), "ts": 1000 + s, "step": s}
                  for s in range(points)])
    spool.append([{"op": "status", "status": "FINISHED", "ts": 2}])
    return spool


def test_batched_delivery_to_the_embedded_store_is_exactly_once_and_ordered(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spool = _spool_run(tmp_path / "run", uri, 2500)  # 3 log_batch calls of <= 1000 points
    assert deliver(tmp_path / "run") == (0, None)
    assert deliver(tmp_path / "run") == (0, None)  # nothing is sent twice
    client = MlflowClient(uri)
    run = client.get_run(spool.state()["run_id"])
    assert run.info.status == "FINISHED" and run.data.params == {"a.b": "1"} and run.data.tags["strategy"] == "ddp"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert steps == list(range(2500))


def test_unreachable_server_keeps_everything_in_the_spool(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    spool = _spool_run(tmp_path / "run", f"http://127.0.0.1:{port}", 10)
    start = time.monotonic()
    pending, error = deliver(tmp_path / "run")
    assert time.monotonic() - start < 30
    assert pending == 13 and error
    assert spool.pending_count() == 13 and "run_id" not in spool.state()


def test_a_line_torn_by_a_crash_does_not_break_later_appends_or_delivery(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spool = _spool_run(tmp_path / "run", uri, 3)
    with open(spool.path, "ab") as fh:
        fh.write(b'{"op":"metric","key":"loss","val')  # power lost mid-line
    spool.append([{"op": "metric", "key": "loss", "value": 0.5, "ts": 9999, "step": 3}])
    assert deliver(tmp_path / "run") == (0, None)
    client = MlflowClient(uri)
    assert [m.step for m in client.get_metric_history(spool.state()["run_id"], "loss")] == [0, 1, 2, 3]


def test_delivery_resumes_from_its_byte_offset_instead_of_rereading_the_spool(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spool = _spool_run(tmp_path / "run", uri, 5)
    assert deliver(tmp_path / "run") == (0, None)
    state = spool.state()
    assert state["offset"] == spool.path.stat().st_size and state["delivered"] == 8
    spool.append([{"op": "metric", "key": "loss", "value": 0.1, "ts": 5000, "step": 5}])
    assert spool.pending(spool.state())[0] == [{"op": "metric", "key": "loss", "value": 0.1, "ts": 5000, "step": 5}]
    assert deliver(tmp_path / "run") == (0, None)
    steps = [m.step for m in MlflowClient(uri).get_metric_history(state["run_id"], "loss")]
    assert steps == [0, 1, 2, 3, 4, 5]


def test_a_spool_cut_before_what_was_delivered_still_delivers_what_is_appended_after_the_cut(tmp_path):
    """A crash cut the spool inside records already delivered; a later launch appends to it. Delivery
    used to resume at the old offset (past the end, or inside the new records) and skip them."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spool = _spool_run(tmp_path / "run", uri, 5)
    assert deliver(tmp_path / "run") == (0, None)
    size = spool.path.stat().st_size
    with open(spool.path, "r+b") as fh:
        fh.truncate(size - 60)  # inside the FINISHED record and the last point, both delivered
    spool.append([{"op": "status", "status": "RUNNING", "ts": 3},
                  {"op": "metric", "key": "loss", "value": 0.1, "ts": 5000, "step": 5},
                  {"op": "status", "status": "KILLED", "ts": 4}])
    assert deliver(tmp_path / "run") == (0, None)
    client = MlflowClient(uri)
    run_id = spool.state()["run_id"]
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [0, 1, 2, 3, 4, 5]
    assert client.get_run(run_id).info.status == "KILLED"
    assert spool.state()["tears"] == [{"at": size - 60, "before_delivered": 60}]


def test_a_record_torn_mid_spool_is_reported_and_its_points_come_back_from_metrics_jsonl(tmp_path):
    """A crash tore step 2's metric record; the job went on appending. Delivery skipped the torn line
    and the run silently lacked step 2; now the tear is reported and metrics.jsonl fills the gap."""
    from trainkit.tracking import recovery

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_dir = tmp_path / "run"
    spool = _spool_run(run_dir, uri, 2, key="train/loss")  # steps 0, 1 and FINISHED, as MlflowSink spools `loss`
    with open(spool.path, "ab") as fh:
        fh.write(b'{"op":"metric","key":"train/loss","val')  # power lost mid-line
    torn_at = spool.path.stat().st_size
    spool.append([{"op": "metric", "key": "train/loss", "value": 0.25, "ts": 3000, "step": 3}])
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "time": 1 + s / 1000, "loss": 1.0 / (s + 1)}) + "\n" for s in range(4)))
    recovery.repair(run_dir)
    assert deliver(run_dir) == (0, None)
    history = MlflowClient(uri).get_metric_history(spool.state()["run_id"], "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 1.0), (1, 0.5), (2, 1 / 3), (3, 0.25)]  # each once
    lines, lost = recovery.report(run_dir)
    assert lost and lines == [f"the tracking spool was torn at byte {torn_at} (a record cut mid-line: a crash "
                              f"while appending); one metric record in it is lost",
                              "steps 2 (1 metric point(s)) re-sent from metrics.jsonl"]
    recovery.repair(run_dir)  # a second sync finds nothing new and sends nothing twice
    assert deliver(run_dir) == (0, None)
    assert len(MlflowClient(uri).get_metric_history(spool.state()["run_id"], "train/loss")) == 4
