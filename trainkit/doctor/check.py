"""One row of the doctor's table: what was measured, and what to do about it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Status = Literal["pass", "warn", "fail"]


@dataclass(frozen=True)
class Check:
    """`fix` is empty for a pass; for a warn or fail it is the command or recipe change to make."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def passed(name: str, detail: str) -> Check:
    return Check(name, "pass", detail)


def warned(name: str, detail: str, fix: str) -> Check:
    return Check(name, "warn", detail, fix)


def failed(name: str, detail: str, fix: str) -> Check:
    return Check(name, "fail", detail, fix)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
