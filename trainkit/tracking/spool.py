"""The tracking spool: every param, tag, metric point, artifact and status change of a run is first
appended (and fsynced) to RUN_DIR/tracking/spool.jsonl, then delivered to MLflow in order.

So nothing is lost when the tracking server is down at start or goes away mid-run: records wait
in the spool and are delivered when it returns, at the end of the run, or by `trainkit sync`.
`state.json` remembers the MLflow run id and how many records were delivered.
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from ..run_dir import TRACKING


class Spool:
    def __init__(self, run_dir: Path):
        self.folder = Path(run_dir) / TRACKING  # created by the first write, not by looking
        self.path = self.folder / "spool.jsonl"
        self.state_path = self.folder / "state.json"

    # ---- writing (any process; appends are atomic lines under an exclusive lock)
    def append(self, records: list[dict[str, Any]], durable: bool = True) -> None:
        """Append records. durable=False skips fsync: the lines survive a crash of this process (the
        kernel has them) but not of the machine — the trade made for per-step metric points."""
        if records:
            with self._locked("append"):
                self._write(records, durable)

    def append_unless_created(self, records: list[dict[str, Any]]) -> bool:
        """Append the run-creating records unless a launcher already did; True if this call did."""
        with self._locked("append"):
            if any(r["op"] == "create" for r in self.records()):
                return False
            self._write(records)
            return True

    def append_rewind(self, step: int, record: dict[str, Any]) -> bool:
        """Append a `rewind` record if the current MLflow run already holds (or will receive) a
        metric point after `step`; True if it did. The scan and the append happen under the append
        lock, so no metric can slip in between."""
        with self._locked("append"):
            later = False
            for r in self.records():
                if r["op"] in ("create", "rewind"):
                    later = False  # a new run starts here: only its own points count
                elif r["op"] == "metric" and r["step"] > step:
                    later = True
            if later:
                self._write([record])
            return later

    def _write(self, records: list[dict[str, Any]], durable: bool = True) -> None:
        data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data  # a line torn by a crash stays a (skipped) line of its own
            view = memoryview(data)
            while view:  # os.write may write less than asked (full disk, signals)
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)

    # ---- reading / delivery bookkeeping
    def records(self, start: int = 0) -> list[dict[str, Any]]:
        """Complete records from index `start` (a torn last line from a crash is ignored)."""
        return self.pending({"delivered": start})[0]

    def pending(self, state: dict[str, Any]) -> tuple[list[dict[str, Any]], list[int]]:
        """The undelivered records and the byte offset after each, read from where delivery stopped
        (state["offset"]) so a long run's spool is not re-read from the top every few seconds."""
        if not self.path.exists():
            return [], []
        offset, skip = state.get("offset"), 0
        if offset is None:  # nothing delivered yet (or a state written before offsets were kept)
            offset, skip = 0, state.get("delivered", 0)
        out, ends = [], []
        with open(self.path, "rb") as fh:
            fh.seek(offset)
            for line in fh:
                offset += len(line)
                if not line.endswith(b"\n"):
                    break
                if skip:
                    skip -= 1
                    continue
                try:
                    out.append(json.loads(line))
                except ValueError:  # torn by a machine crash: keep its place, deliver nothing
                    out.append({"op": "torn"})
                ends.append(offset)
        return out, ends

    def torn_lines(self, start: int = 0) -> list[tuple[int, bytes]]:
        """(byte offset where the record was cut, what is left of it) for every line from `start`
        that is not a record: a crash cut it mid-record and a later append (or `trainkit sync`)
        ended it with a newline."""
        if not self.path.exists():
            return []
        out, offset = [], 0
        with open(self.path, "rb") as fh:
            for line in fh:
                begin, offset = offset, offset + len(line)
                if begin < start or not line.endswith(b"\n"):
                    continue
                try:
                    json.loads(line)
                except ValueError:
                    out.append((offset - 1, line[:-1]))
        return out

    def end_torn_tail(self) -> Optional[int]:
        """End a last record cut mid-line (a crash while appending) with a newline, making it a torn
        line of its own; returns the byte where it was cut (None when the spool ends whole). Only
        with no process appending: an append in flight lacks its newline for a moment too."""
        if not self.path.exists():
            return None
        with self._locked("append"):
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
            try:
                size = os.fstat(fd).st_size
                if not size or os.pread(fd, 1, size - 1) == b"\n":
                    return None
                os.write(fd, b"\n")
                os.fsync(fd)
                return size
            finally:
                os.close(fd)

    def realign(self, state: dict[str, Any]) -> Optional[dict[str, Any]]:
        """Delivery resumes at state["offset"]. If the spool was cut before it (a crash while
        appending, a disk that lost its tail), that offset lies past the end or inside a record, and
        reading from it would skip every record appended after the cut. Move it (and the delivered
        count) to the line after the cut -- the last torn line before the offset, else the end --
        and return the cut {"at": byte, "before_delivered": bytes} (None when the offset is sound)."""
        offset = state.get("offset")
        if not offset or not self.path.exists():
            return None
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if offset <= size:
                fh.seek(offset - 1)
                if fh.read(1) == b"\n":
                    return None
            fh.seek(0)
            head = fh.read()
        torn = [at for at, _ in self.torn_lines() if at < offset]
        resume = torn[-1] + 1 if torn else head.rfind(b"\n", 0, min(offset, size)) + 1
        at = torn[-1] if torn else min(offset, size)
        state.update(offset=resume, delivered=head[:resume].count(b"\n"), uncertain=True)
        return {"at": at, "before_delivered": offset - at}

    def state(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {"delivered": 0}

    def save_state(self, state: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        with open(tmp, "w") as fh:
            json.dump(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.state_path)

    def pending_count(self) -> int:
        return max(0, len(self.records()) - self.state().get("delivered", 0))

    @contextmanager
    def _locked(self, name: str, blocking: bool = True) -> Iterator[bool]:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / f".{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def delivery_lock(self):
        """Only one process delivers at a time (non-blocking: yields False if another one is)."""
        return self._locked("deliver", blocking=False)


def note_tear(state: dict[str, Any], tear: dict[str, Any]) -> None:
    """Remember a cut in state["tears"] (one entry per cut byte), so every later `trainkit sync`
    still reports what it lost."""
    tears = state.setdefault("tears", [])
    known = next((t for t in tears if t["at"] == tear["at"]), None)
    if known is None:
        tears.append(dict(tear))
    else:
        known.update({k: v for k, v in tear.items() if v is not None})


def run_id(run_dir: Path) -> Optional[str]:
    return Spool(run_dir).state().get("run_id")
