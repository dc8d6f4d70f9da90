"""Which rank a hang under NCCL waits for, from the ranks' NCCL Flight Recorder records.

Why not the stacks: under NCCL a collective call only enqueues work on the GPU stream and returns, so
the host runs ahead and blocks later, in whatever synchronises (the loop's `.tolist()` of the step's
metrics, the non-finite check). The healthy ranks then look stuck in trainkit code and the stuck one
can look ahead, so the stack rule of `hang_watch._behind` (made for gloo, where a rank inside a
collective waits for the others) blames the wrong rank. NCCL's own record (torch's Flight Recorder,
`dump_nccl_trace_pickle`) holds, per process group, each collective's sequence number and its state
on this rank's GPU: `scheduled` (enqueued by the host), `started` (its kernel runs: it waits for the
peers), `completed`. That is the evidence used here:

1. a rank that issued fewer collectives of a group than the others never entered the one they wait
   in: it is behind (its host is stuck before the call);
2. with the same newest collective everywhere, a rank where it is still `scheduled` while it is
   `started` elsewhere has a GPU stream busy with earlier work (a hung kernel, a slow copy): behind;
3. every rank `started` and none `completed`: no rank is behind; the collective itself hangs (the
   network, NCCL's transport), and the report says so.

`started` exists only where NCCL records a start event per collective, which ProcessGroupNCCL does
only with TORCH_NCCL_ENABLE_TIMING=1 (its WorkNCCL makes `ncclStartEvent_` only when timing is on, and
FlightRecorder::update_state reports `started` only from that event): the launcher sets it under NCCL
(`hang_watch.flight_recorder_env`). A run that turned it off gets rule 1 only; where rule 1 names
nobody, the verdict says the record cannot tell (no start times anywhere in the records) instead of
falling back on the stacks, which mislead under NCCL.

Fields read, as torch writes them (torch/csrc/distributed/c10d/FlightRecorder*, read back by
torch.distributed.flight_recorder.components.types): `entries[].process_group` (name, desc),
`collective_seq_id`, `profiling_name` ("nccl:all_reduce"), `state`, `is_p2p`; `pg_config[name].ranks`
(the group's global ranks, a string "[0, 1]"). Point-to-point entries are left out: their sequence is
per peer pair.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Blame:
    rank: Optional[int]  # None: no rank is behind (the collective itself hangs)
    why: str


def blame(records: dict[int, dict]) -> Optional[Blame]:
    """The rank the others wait for, by group (the first group that names one wins), or None when the
    records say nothing (no collective entries, a single rank)."""
    verdicts = [v for v in (_group_verdict(name, records) for name in _groups(records)) if v is not None]
    behind = [v for v in verdicts if v.rank is not None]
    return (behind or verdicts or [None])[0]


def _groups(records: dict[int, dict]) -> list[str]:
    names: dict[str, None] = {}
    for record in records.values():
        for entry in _collectives(record):
            names.setdefault(entry["process_group"][0])
    return list(names)


def _collectives(record: dict) -> list[dict]:
    return [e for e in record.get("entries", []) if not e.get("is_p2p") and e.get("collective_seq_id") is not None]


def _members(name: str, records: dict[int, dict]) -> list[int]:
    """The group's ranks that handed over a record (its pg_config where a record has it)."""
    for record in records.values():
        config = (record.get("pg_config") or {}).get(name)
        if config and config.get("ranks"):
            ranks = config["ranks"]
            ranks = ast.literal_eval(ranks) if isinstance(ranks, str) else ranks
            return [r for r in ranks if r in records]
    return [r for r, record in records.items() if any(e["process_group"][0] == name for e in _collectives(record))]


def _group_verdict(name: str, records: dict[int, dict]) -> Optional[Blame]:
    members = _members(name, records)
    if len(members) < 2:
        return None
    newest: dict[int, Optional[dict]] = {}
    for rank in members:
        entries = [e for e in _collectives(records[rank]) if e["process_group"][0] == name]
        newest[rank] = max(entries, key=lambda e: e["collective_seq_id"]) if entries else None
    issued = {rank: (e["collective_seq_id"] if e else -1) for rank, e in newest.items()}
    last = max(issued.values())
    label = _label(name, records)
    if min(issued.values()) < last:
        rank = min(members, key=lambda r: (issued[r], r))
        waited = next(e for e in newest.values() if e and e["collective_seq_id"] == last)
        entered = f"only up to #{issued[rank]}" if issued[rank] >= 0 else "none"
        return Blame(rank, f"NCCL Flight Recorder: the other ranks of {label} entered collective #{last} "
                           f"({_op(waited)}); rank {rank} issued {entered}: its host never reached the call")
    states = {rank: newest[rank]["state"] for rank in members}
    if all(s == "completed" for s in states.values()):
        return None
    scheduled = [r for r in members if states[r] == "scheduled"]
    started = [r for r in members if states[r] == "started"]
    if scheduled and started:
        rank = scheduled[0]
        return Blame(rank, f"NCCL Flight Recorder: collective #{last} ({_op(newest[rank])}) of {label} runs on "
                           f"rank(s) {', '.join(map(str, started))} but has not started on rank {rank}'s GPU: "
                           f"its stream is still busy with earlier work")
    if started and len(started) == len(members):
        return Blame(None, f"NCCL Flight Recorder: every rank of {label} is inside collective #{last} "
                           f"({_op(newest[members[0]])}) and none completed it: no rank is behind; the "
                           f"collective itself hangs (the network or NCCL's transport: NCCL_DEBUG=INFO says more)")
    if not started and not _start_times_recorded(records):
        return Blame(None, f"NCCL Flight Recorder: every rank of {label} enqueued collective #{last} "
                           f"({_op(newest[members[0]])}) and none completed it; the records hold no start time at "
                           f"all -- start events are off (TORCH_NCCL_ENABLE_TIMING=0), or no collective has started "
                           f"on any GPU yet -- so they cannot tell a GPU still busy with earlier work from a "
                           f"collective that hangs: the stacks below do not say either under NCCL")
    return None


def _start_times_recorded(records: dict[int, dict]) -> bool:
    """Whether NCCL recorded start events (TORCH_NCCL_ENABLE_TIMING): then every collective that
    started or completed has its start time; without them none has."""
    return any(e.get("time_discovered_started_ns") is not None
               for record in records.values() for e in record.get("entries", []))


def _label(name: str, records: dict[int, dict]) -> str:
    for record in records.values():
        for entry in _collectives(record):
            if entry["process_group"][0] == name:
                desc = entry["process_group"][1]
                return f"process group {name}" + (f" ({desc})" if desc and desc != "undefined" else "")
    return f"process group {name}"


def _op(entry: dict) -> str:
    return entry.get("profiling_name", "?")
