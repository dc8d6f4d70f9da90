"""Hang blame under NCCL (issue 41): the rank behind is read from the ranks' NCCL Flight Recorder
records, not from where their host stacks wait. Under NCCL a collective call returns at once, so the
healthy ranks block later in trainkit's own code (the loop's `.tolist()`) and the stuck rank can even
be a step "ahead"; the stack rule, made for gloo, then blames a healthy rank.

In-process, on records laid out as torch writes them (`dump_nccl_trace_pickle`: entries with
process_group, collective_seq_id, profiling_name, state, is_p2p; pg_config with each group's ranks),
as the launcher's TORCH_NCCL_ENABLE_TIMING=1 makes them (a start time on each collective that
started); one test reads records torch's own writer made (gloo's, the same FlightRecorder code).
Not yet checked against a real NCCL hang: no GPU was lent when this was written (docs/running.md)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
from run_helpers import free_port

from trainkit.launch import flight_recorder_dumps, hang_watch, nccl_blame
from trainkit.launch.hang_watch import Rank, _behind

WORLD = [0, 1, 2, 3]


def entry(seq: int, state: str, group=("0", "default_pg"), op="nccl:all_reduce", p2p=False, timing=True) -> dict:
    """A record as ProcessGroupNCCL writes it; with `timing` (TORCH_NCCL_ENABLE_TIMING=1, the launcher's
    default) a collective that started or completed has its start time, without it none has."""
    started = seq * 1000 + 1 if timing and state in ("started", "completed") else None
    return {"record_id": seq, "pg_id": int(group[0]), "process_group": group, "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": op, "time_created_ns": seq * 1000,
            "input_sizes": [[7556]], "input_dtypes": ["Float"], "output_sizes": [[7556]],
            "output_dtypes": ["Float"], "state": state, "time_discovered_started_ns": started,
            "time_discovered_completed_ns": seq * 1000 + 2 if state == "completed" else None,
            "retired": state == "completed", "timeout_ms": 600000, "is_p2p": p2p, "frames": []}


def record(entries: list[dict], groups=None) -> dict:
    groups = groups or {"0": {"name": "0", "desc": "default_pg", "ranks": str(WORLD)}}
    return {"version": "2.10", "pg_config": groups, "pg_status": {}, "comm_lib_version": "2.27.3",
            "entries": entries}


def done(upto: int, timing=True) -> list[dict]:
    return [entry(s, "completed", timing=timing) for s in range(1, upto + 1)]


def rank(number: int, step: int, phase: str, innermost: str) -> Rank:
    r = Rank({"rank": number, "pid": 1000 + number, "step": step, "phase": phase}, state="S (sleeping)")
    r.innermost = innermost
    return r


TOLIST = 'File "trainkit/runtime/loop.py", line 210, in _step_metrics: values = torch.stack(metrics).tolist()'


def test_a_rank_whose_host_never_reached_the_collective_is_blamed_though_it_looks_ahead():
    """Ranks 0, 2, 3 enqueued all-reduce #21 (started on their GPUs: waiting for rank 1) and their hosts
    block in trainkit's `.tolist()` at step 7; rank 1's host is stuck before the call, yet it recorded
    step 8's phase. The stack rule names rank 0 (least progress); the NCCL record names rank 1."""
    records = {r: record(done(20) + [entry(21, "started")]) for r in (0, 2, 3)}
    records[1] = record(done(20))
    ranks = [rank(0, 7, "optimizer", TOLIST), rank(1, 8, "forward", 'File "model.py", line 3, in forward'),
             rank(2, 7, "optimizer", TOLIST), rank(3, 7, "optimizer", TOLIST)]
    assert _behind(ranks)[0].number != 1  # what the stack rule alone concludes: a healthy rank
    behind, why = _behind(ranks, nccl_blame.blame(records))
    assert behind.number == 1, why
    assert "entered collective #21 (nccl:all_reduce)" in why and "rank 1 issued only up to #20" in why
    assert "process group 0 (default_pg)" in why


def test_a_rank_whose_gpu_has_not_started_the_collective_is_blamed():
    """All four hosts enqueued #21; on rank 2 it is still `scheduled` (its stream is busy with an
    earlier kernel), on the others `started`: rank 2 is behind."""
    records = {r: record(done(20) + [entry(21, "scheduled" if r == 2 else "started")]) for r in WORLD}
    blame = nccl_blame.blame(records)
    assert blame.rank == 2 and "has not started on rank 2's GPU" in blame.why and "rank(s) 0, 1, 3" in blame.why


def test_every_rank_inside_the_collective_blames_no_rank_but_the_collective():
    records = {r: record(done(20) + [entry(21, "started")]) for r in WORLD}
    blame = nccl_blame.blame(records)
    assert blame.rank is None and "no rank is behind" in blame.why and "NCCL_DEBUG=INFO" in blame.why
    ranks = [rank(r, 7, "optimizer", TOLIST) for r in WORLD]
    assert _behind(ranks, blame)[1] == blame.why


def test_the_group_that_waits_is_found_among_several_and_point_to_point_records_are_left_out():
    """A tensor-parallel pair (ranks 2, 3: group 2) stuck while the data-parallel groups completed:
    rank 3 never issued tp all-gather #5. Pipeline sends (point to point) on rank 3 change nothing."""
    groups = {"0": {"name": "0", "desc": "default_pg", "ranks": str(WORLD)},
              "2": {"name": "2", "desc": "mesh_tp", "ranks": "[2, 3]"}}
    tp = ("2", "mesh_tp")
    records = {r: record(done(9), groups) for r in (0, 1)}
    records[2] = record(done(9) + [entry(s, "completed", tp, "nccl:all_gather_into_tensor") for s in range(1, 5)]
                        + [entry(5, "started", tp, "nccl:all_gather_into_tensor")], groups)
    records[3] = record(done(9) + [entry(s, "completed", tp, "nccl:all_gather_into_tensor") for s in range(1, 5)]
                        + [entry(40, "started", ("1", "pp"), "nccl:send 3->0", p2p=True)], groups)
    blame = nccl_blame.blame(records)
    assert blame.rank == 3 and "process group 2 (mesh_tp)" in blame.why and "#5" in blame.why


def test_completed_records_or_one_rank_name_nobody():
    assert nccl_blame.blame({r: record(done(20)) for r in WORLD}) is None
    assert nccl_blame.blame({0: record(done(3) + [entry(4, "started")])}) is None
    assert nccl_blame.blame({}) is None


def test_the_pickled_record_is_read_as_torch_writes_it_and_gloo_records_are_ignored():
    """flight_recorder_dumps keeps NCCL's pickled record per rank for the blame; an empty or foreign
    answer (gloo's ranks have no NCCL record) gives nothing, and never raises."""
    native = record(done(2))
    assert flight_recorder_dumps._with_entries(pickle.dumps(native)) == native
    assert flight_recorder_dumps._with_entries(b"") == {}
    assert flight_recorder_dumps._with_entries(pickle.dumps({"entries": []})) == {}
    assert flight_recorder_dumps._with_entries(b"not a pickle") == {}


def test_without_start_events_a_collective_no_rank_completed_is_said_to_be_undecidable_not_blamed_on_a_stack():
    """With TORCH_NCCL_ENABLE_TIMING off NCCL records no start event, so no collective is ever `started`:
    a GPU busy with earlier work and a collective that hangs look alike (all `scheduled`). The verdict
    says so and names no rank, rather than letting the stack rule, wrong under NCCL, pick one. With
    start events on, the same all-`scheduled` record means every GPU is still busy: no verdict."""
    records = {r: record(done(20, timing=False) + [entry(21, "scheduled", timing=False)]) for r in WORLD}
    blame = nccl_blame.blame(records)
    assert blame.rank is None and "TORCH_NCCL_ENABLE_TIMING=0" in blame.why and "#21" in blame.why
    # with start events on, a hang at the very first collective has no start time either: the verdict
    # does not claim the run turned them off
    first = nccl_blame.blame({r: record([entry(1, "scheduled")]) for r in WORLD})
    assert first.rank is None and "or no collective has started on any GPU yet" in first.why
    assert _behind([rank(r, 7, "optimizer", TOLIST) for r in WORLD], blame)[1] == blame.why
    assert nccl_blame.blame({r: record(done(20) + [entry(21, "scheduled")]) for r in WORLD}) is None
    # rule 1 needs no start events: the rank that issued less is named either way
    records[1] = record(done(20, timing=False))
    assert nccl_blame.blame(records).rank == 1


def test_the_launcher_asks_nccl_for_start_events_and_its_timeout_dumps_and_a_users_value_wins(tmp_path):
    nccl = hang_watch.flight_recorder_env(tmp_path, {}, "cuda:nccl,cpu:gloo")
    assert nccl["TORCH_NCCL_ENABLE_TIMING"] == "1" and nccl["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert "TORCH_NCCL_ENABLE_TIMING" not in hang_watch.flight_recorder_env(tmp_path, {"TORCH_NCCL_ENABLE_TIMING": "0"},
                                                                            "nccl")
    assert set(hang_watch.flight_recorder_env(tmp_path, {}, "gloo")) == {"TORCH_FR_BUFFER_SIZE"}


TORCH_WRITES = """
import os, pickle, torch, torch.distributed as dist
import torch._C._distributed_c10d as c10d
dist.init_process_group("gloo")
rank = dist.get_rank()
for _ in range(3 if rank == 0 else 2):  # rank 1 never issues the third all-reduce
    dist.all_reduce(torch.ones(4), async_op=True)
with open(os.environ["DUMP"] + str(rank), "wb") as f:
    f.write(c10d._dump_fr_trace())
os._exit(0)  # rank 0's third all-reduce never completes: no teardown
"""


@pytest.mark.slow
def test_records_written_by_torchs_own_flight_recorder_are_read_and_the_rank_that_issued_less_is_named(tmp_path):
    """The fields the blame reads are those torch's FlightRecorder writes: two gloo ranks (gloo records
    into the same FlightRecorder, through the same writer, as NCCL) dump their record after rank 1
    issued one all-reduce fewer than rank 0; the blame, on those records as they come, names rank 1."""
    port = free_port()
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "100", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "DUMP": str(tmp_path / "rank")}
    ranks = [subprocess.Popen([sys.executable, "-c", TORCH_WRITES], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    try:
        outputs = [p.communicate(timeout=60)[0].decode() for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert all(p.returncode == 0 for p in ranks), outputs
    records = {r: pickle.loads((tmp_path / f"rank{r}").read_bytes()) for r in (0, 1)}
    assert [e["collective_seq_id"] for e in records[0]["entries"]] == [1, 2, 3]
    blame = nccl_blame.blame(records)
    assert blame.rank == 1 and "entered collective #3 (gloo:all_reduce)" in blame.why, blame
    assert "rank 1 issued only up to #2" in blame.why
