"""Ranks that call different collectives (a desync): `launch.debug_collectives` turns on torch's own
checks for the workers, and a rank's mismatch error becomes one line naming both sides.

Why torch's checks: under TORCH_DISTRIBUTED_DEBUG=DETAIL, `init_process_group` wraps gloo and NCCL
groups in a ProcessGroupWrapper, which before every collective compares the ranks' fingerprints
(sequence number, op, shapes, dtypes) over a helper gloo group and raises on every rank "Detected
mismatch between collectives on ranks. Rank A is running collective: CollectiveFingerPrint(...), but
Rank B is running collective: ...". A rank's own side of that message is reliable; once the ranks are
out of step the other side can be the helper group's own exchange (an OpType REDUCE or GATHER no
training code called), so the line is put together from each rank's own side.
"""

from __future__ import annotations

import re
from typing import Optional

from ..runtime.fatal import COLLECTIVE_MISMATCH

DEBUG_ENV = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
MISMATCH = COLLECTIVE_MISMATCH
_SIDE = re.compile(r"Rank (\d+) is running collective: (CollectiveFingerPrint\(.*?)(?=, but Rank \d+ is running|$)",
                   re.S)


def debug_env(enabled: bool, environ) -> dict:
    """The workers' environment for launch.debug_collectives (a value already set wins)."""
    return {k: v for k, v in DEBUG_ENV.items() if k not in environ} if enabled else {}


def fingerprint(text: str) -> str:
    """'ALLREDUCE #12 of shape [3396], Float' from torch's CollectiveFingerPrint(...) text."""
    def field(pattern: str) -> Optional[str]:
        found = re.search(pattern, text)
        return found.group(1) if found else None

    op, seq, shape, dtype = (field(r"OpType=(\w+)"), field(r"SequenceNumber=(\d+)"),
                             field(r"TensorShape=(\[[^\]]*\])"), field(r"TensorDtypes=(\w+)"))
    return f"{op or '?'} #{seq or '?'}" + (f" of shape {shape}" if shape else "") + (f", {dtype}" if dtype else "")


def sides(messages: dict) -> dict[int, str]:
    """Each rank's collective at the mismatch, from the ranks' error messages (rank -> message): a
    rank's own side first, the other side only for a rank whose own error is missing."""
    own, told = {}, {}
    for text in messages.values():
        if MISMATCH not in str(text):
            continue
        found = _SIDE.findall(str(text))
        if found:
            own.setdefault(int(found[0][0]), fingerprint(found[0][1]))
            for rank, other in found[1:]:
                told.setdefault(int(rank), fingerprint(other))
    return dict(sorted({**told, **own}.items()))


def explain(messages: dict) -> Optional[str]:
    """One line naming both sides of a collective mismatch, or None when no rank reported one."""
    found = sides(messages)
    if len(found) < 2:
        return None
    ops = {side.split(" #")[0] for side in found.values()}
    why = ("the ranks called different collectives: a rank skipped or added one (a data-dependent branch, a "
           "rank-dependent condition)" if len(ops) > 1 else
           "the same collective with other shapes or dtypes: a rank called it with another tensor (an uneven "
           "last batch, a rank-dependent model), or skipped one and is already at its next")
    return ("trainkit: collective desync (launch.debug_collectives): " +
            "; ".join(f"rank {rank} runs {side}" for rank, side in found.items()) + f": {why}")
