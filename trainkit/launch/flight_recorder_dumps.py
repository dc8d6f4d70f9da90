"""The hang report's "Flight Recorder" section: each live rank's Flight Recorder dump, fetched while the
rank is blocked, laid out as torch's analysis tool reads it, and that tool's verdict.

Each watched rank records every process group's collectives (`trainkit.runtime.flight_recorder`) and
serves the record from a C++ thread on its socket in the launch's private directory. On a hang this
module asks each rank that can answer (a stopped process cannot) for its record (`fr_trace_json`),
writes it as RUN_DIR/reports/flight-recorder/rank<R> in the pickle format of torch's dumps, and runs
`python -m torch.distributed.flight_recorder.fr_trace` on that folder: it matches the ranks'
collectives by group and sequence number and says which ranks did not join which collective. A rank
whose backend records natively (NCCL) also hands over that record (`dump_nccl_trace_pickle`), kept
as RUN_DIR/reports/nccl-trace-rank<R>, the prefix of NCCL's own dumps on a timeout.

The hook's records are named `c10d:<op>` ("c10d:allreduce"); the analysis accepts only backend
names and its own op vocabulary ("gloo:all_reduce"), so the records are renamed here. A backend that
also records natively into the same buffer (gloo does) adds a second record of each collective under
its own name and without its group's configuration: those are left out, so that the analysis sees one
record per collective on every backend. Point-to-point records (the pipeline's) are left out too: the
hook does not record the peer, which the analysis needs.
"""

from __future__ import annotations

import http.client
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..run_dir import FLIGHT_RECORDER, FLIGHT_RECORDER_ANALYSIS, FLIGHT_RECORDER_DUMP, NCCL_TRACE, report_path
from ..runtime.flight_recorder import SOCKETS_ENV, socket_path

HOOK = "c10d"  # the hook's records: "c10d:<op>"
DUMP_PREFIX = FLIGHT_RECORDER_DUMP  # RUN_DIR/reports/flight-recorder/rank<R>: fr_trace's `-p` prefix
FETCH_TIMEOUT_S = 5.0
ANALYSIS_TIMEOUT_S = 60.0
ANALYSIS_LINES = 60  # of fr_trace's output in hang.md (all of it in flight-recorder/analysis.txt)
ANALYSIS = FLIGHT_RECORDER_ANALYSIS
# the hook's op names -> the analysis's (torch.distributed.flight_recorder.components.types.COLLECTIVES)
OP_NAMES = {"allreduce": "all_reduce", "allgather": "all_gather", "alltoall": "all_to_all",
            "allreduce_coalesced": "allreduce_coalesced", "reduce_scatter": "reduce_scatter",
            "broadcast": "broadcast", "barrier": "barrier", "reduce": "reduce", "gather": "gather",
            "scatter": "scatter"}
IN_PLACE = {"all_reduce", "allreduce_coalesced", "broadcast", "reduce"}  # the result overwrites the input
SOCKET_PATH_MAX = 100  # a Unix socket's path holds at most 107 bytes; "/trainkit-fr-XXXXXXXX/rank<R>.sock" follows


def sockets_directory() -> Path:
    """A directory private to this launch (mode 0700) for the ranks' sockets: in the temporary
    directory, or in /tmp when that path is too long for a socket's."""
    parent = tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix="trainkit-fr-", dir=parent if len(parent) < SOCKET_PATH_MAX - 40 else "/tmp"))


def workers_env(directory: Path) -> dict:
    return {SOCKETS_ENV: str(directory)}


def remove(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


@dataclass
class Dumps:
    """What the ranks answered: their dumps, in the analysis's layout, and who could not answer why."""

    folder: Path
    ranks: dict = field(default_factory=dict)  # rank -> its dump (the analysis's format)
    missing: dict = field(default_factory=dict)  # rank -> why there is no dump
    native: list = field(default_factory=list)  # ranks whose backend's own record was saved too
    native_records: dict = field(default_factory=dict)  # rank -> that record (NCCL's), unpickled
    left_out: int = 0  # point-to-point or unknown records


def collect(run_dir: Path, directory: Path, ranks: dict, backend: str) -> Dumps:
    """Ask each rank of `ranks` (rank -> why it cannot answer, '' when it can) for its record."""
    dumps = Dumps(report_path(run_dir, FLIGHT_RECORDER))
    shutil.rmtree(dumps.folder, ignore_errors=True)  # this hang's dumps only
    dumps.folder.mkdir(parents=True, exist_ok=True)
    label = backend.split(",")[0].rpartition(":")[2] or "gloo"  # "cuda:nccl,cpu:gloo" -> nccl: a label
    for rank, cannot in sorted(ranks.items()):
        if cannot:
            dumps.missing[rank] = cannot
            continue
        try:
            record = json.loads(_ask(socket_path(directory, rank), "fr_trace_json"))
        except (OSError, ValueError, http.client.HTTPException) as exc:
            dumps.missing[rank] = f"no answer from its flight recorder ({type(exc).__name__}: {exc})"
            continue
        try:  # NCCL's own record: a torch built without NCCL has no such handler, which costs only this
            native = _ask(socket_path(directory, rank), "dump_nccl_trace_pickle") if label == "nccl" else b""
        except (OSError, ValueError, http.client.HTTPException):
            native = b""
        dump, left_out = for_analysis(record, label)
        dumps.ranks[rank], dumps.left_out = dump, dumps.left_out + left_out
        (dumps.folder / f"{DUMP_PREFIX}{rank}").write_bytes(pickle.dumps(dump))
        parsed = _with_entries(native)
        if parsed:  # NCCL's own record (empty on other backends)
            report_path(run_dir, f"{NCCL_TRACE}{rank}").write_bytes(native)
            dumps.native.append(rank)
            dumps.native_records[rank] = parsed
    return dumps


def _with_entries(dump: bytes) -> dict:
    """The unpickled record when it holds entries, else {} (torch writes plain dicts, lists and strings)."""
    try:
        record = pickle.loads(dump) if dump else {}
        return record if isinstance(record, dict) and record.get("entries") else {}
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError):
        return {}


def for_analysis(record: dict, label: str) -> tuple[dict, int]:
    """A rank's JSON record as torch's dump pickle holds it, with the hook's records only, renamed
    for the analysis; and how many records were left out (point-to-point, unknown ops)."""
    entries, left_out = [], 0
    for entry in record.get("entries", []):
        origin, _, op = entry["profiling_name"].partition(":")
        if origin != HOOK:  # the backend's own record of the same collective
            continue
        if entry.get("is_p2p") or op not in OP_NAMES:
            left_out += 1
            continue
        entries.append(_as_analysed(entry, label, OP_NAMES[op]))
    return {"version": record.get("version", ""), "pg_config": record.get("pg_config", {}),
            "pg_status": record.get("pg_status", {}), "comm_lib_version": record.get("comm_lib_version", ""),
            "entries": entries}, left_out


def _as_analysed(entry: dict, label: str, op: str) -> dict:
    """The hook's record as the analysis compares it: an in-place collective's output is its input
    (the hook records no output for it), and a list of equal outputs (all_gather into a list) is one
    stacked output, as the backends record them."""
    entry = {**entry, "profiling_name": f"{label}:{op}", "process_group": tuple(entry["process_group"])}
    if op in IN_PLACE and not entry["output_sizes"]:
        entry.update(output_sizes=entry["input_sizes"], output_dtypes=entry["input_dtypes"])
    for sizes, dtypes in (("input_sizes", "input_dtypes"), ("output_sizes", "output_dtypes")):
        shapes = entry[sizes]
        if len(shapes) > 1 and op not in IN_PLACE and all(s == shapes[0] for s in shapes):
            entry.update({sizes: [[len(shapes), *shapes[0]]], dtypes: entry[dtypes][:1]})
    return entry


def analyse(dumps: Dumps) -> str:
    """torch's fr_trace on the dumps (allowing missing ranks when some could not answer): its output."""
    if not dumps.ranks:
        return ""
    command = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps.folder),
               "-p", DUMP_PREFIX] + (["--allow-incomplete-ranks"] if dumps.missing else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=ANALYSIS_TIMEOUT_S,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        output = f"(fr_trace did not finish within {ANALYSIS_TIMEOUT_S:g} s)"
    output = "\n".join(line for line in output.splitlines() if "tabulate is not installed" not in line).strip()
    (dumps.folder / ANALYSIS).write_text(output + "\n")
    return output or "(fr_trace found nothing to report: every rank joined every recorded collective)"


def report_lines(dumps: Dumps, analysis: str, run_dir: Path) -> list[str]:
    """hang.md's "Flight Recorder" section."""
    folder = os.path.relpath(dumps.folder, run_dir)
    lines = ["", "## Flight Recorder", "",
             f"Each rank's last collectives, from torch's Flight Recorder on every process group, are in "
             f"`{folder}/{DUMP_PREFIX}<R>`; torch's analysis of them (`python -m "
             f"torch.distributed.flight_recorder.fr_trace {folder} -p {DUMP_PREFIX}`) follows the table.", "",
             "| rank | collectives recorded | last one |", "|---|---|---|"]
    for rank in sorted({*dumps.ranks, *dumps.missing}):
        if rank in dumps.missing:
            lines.append(f"| {rank} | no dump | {dumps.missing[rank]} |")
            continue
        entries = dumps.ranks[rank]["entries"]
        lines.append(f"| {rank} | {len(entries)} | {describe(entries[-1]) if entries else '-'} |")
    if dumps.left_out:
        lines += ["", f"{dumps.left_out} point-to-point or unrecognised records left out of the analysis."]
    if dumps.native:
        lines += ["", f"The backend's own record of ranks {', '.join(map(str, dumps.native))}: "
                      f"`reports/{NCCL_TRACE}<R>` (the same analysis reads them)."]
    shown = _collapsed(analysis.splitlines())
    if not shown:  # no rank could answer: nothing to analyse
        return lines
    lines += ["", *[f"- {line}" for line in verdicts(analysis)]] if verdicts(analysis) else []
    lines += ["", "```", *shown[:ANALYSIS_LINES],
              *([f"... ({len(shown) - ANALYSIS_LINES} more lines in {folder}/{ANALYSIS})"]
                if len(shown) > ANALYSIS_LINES else []), "```"]
    return lines


def _collapsed(lines: list[str]) -> list[str]:
    """Repeated lines once, counted (fr_trace says the same for each collective it cannot decide)."""
    out: list[list] = []
    for line in lines:
        if out and out[-1][0] == line:
            out[-1][1] += 1
        else:
            out.append([line, 1])
    return [line if count == 1 else f"{line} (x{count})" for line, count in out]


def verdicts(analysis: str) -> list[str]:
    """One line per collective fr_trace found some ranks did not join: 'ranks {1} did not join
    gloo:all_reduce #9 of group 0:default_pg (input sizes [[7556]])'."""
    found = []
    for block in analysis.split("Not all ranks joining collective, sequence number: ")[1:]:
        fields = dict(line.split(": ", 1) for line in block.splitlines()[1:] if ": " in line)
        seq = block.split("\n", 1)[0].strip()
        found.append(f"ranks {fields.get('missing ranks', '?')} did not join {fields.get('collective', '?')} "
                     f"#{seq} of group {fields.get('group info', '?')} (input sizes {fields.get('input sizes', '?')})")
    return found


def describe(entry: dict) -> str:
    """'gloo:all_reduce #21 in group 0 (default_pg), sizes [[7556]], Float'."""
    name, desc = entry["process_group"]
    dtypes = ", ".join(entry.get("input_dtypes") or [])
    return (f"{entry['profiling_name']} #{entry['collective_seq_id']} in group {name} ({desc}), "
            f"sizes {entry['input_sizes']}" + (f", {dtypes}" if dtypes else ""))


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def _ask(path: Path, handler: str) -> bytes:
    """The answer of a rank's worker server handler (torch's `/handler/<name>`, POST)."""
    connection = _UnixHTTPConnection(path, FETCH_TIMEOUT_S)
    try:
        connection.request("POST", f"/handler/{handler}", body=b"")
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    if response.status != 200:
        raise ValueError(f"HTTP {response.status} from {handler}: {body[:200]!r}")
    return body
