"""Hang blame under NCCL (issue 41): the rank behind is read from the ranks' NCCL Flight Recorder
records, not from where their host stacks wait. Under NCCL a collective call returns at once, so the
healthy ranks block later in trainkit's own code (the loop's `.tolist()`) and the stuck rank can even
be a step "ahead"; the stack rule, made for gloo, then blames a healthy rank.

In-process, on records laid out as torch writes them (`dump_nccl_trace_pickle`: entries with
process_group, collective_seq_id, profiling_name, state, is_p2p; pg_config with each group's ranks).
Not yet checked against a real NCCL hang: no GPU was lent when this was written (docs/running.md)."""

from __future__ import annotations

import pickle

from trainkit.launch import flight_recorder_dumps, nccl_blame
from trainkit.launch.hang_watch import Rank, _behind

WORLD = [0, 1, 2, 3]


def entry(seq: int, state: str, group=("0", "default_pg"), op="nccl:all_reduce", p2p=False) -> dict:
    return {"record_id": seq, "pg_id": int(group[0]), "process_group": group, "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": op, "time_created_ns": seq * 1000,
            "input_sizes": [[7556]], "input_dtypes": ["Float"], "output_sizes": [[7556]],
            "output_dtypes": ["Float"], "state": state, "time_discovered_started_ns": None,
            "time_discovered_completed_ns": None, "retired": state == "completed", "timeout_ms": 600000,
            "is_p2p": p2p, "frames": []}


def record(entries: list[dict], groups=None) -> dict:
    groups = groups or {"0": {"name": "0", "desc": "default_pg", "ranks": str(WORLD)}}
    return {"version": "2.10", "pg_config": groups, "pg_status": {}, "comm_lib_version": "2.27.3",
            "entries": entries}


def done(upto: int) -> list[dict]:
    return [entry(s, "completed") for s in range(1, upto + 1)]


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
