"""How much memory this process may use, how much it has used, and whether the kernel killed for memory.

Standard library only: read by `doctor` (does the plan fit?), by each rank (its peak and limit, for
the OOM report) and by the launcher (did the OOM killer end a rank?). The limit is the smaller of the
host's MemAvailable and what the process's memory cgroup leaves (v2 `memory.max` - `memory.current`,
v1 `memory.limit_in_bytes` - `memory.usage_in_bytes`): a container's limit is what the kernel's OOM
killer enforces, not the host's RAM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # cgroup v1 writes ~2^63 for "no limit"


@dataclass(frozen=True)
class Limit:
    """Bytes this process may still allocate, and where that figure comes from."""

    available: int
    source: str  # "MemAvailable" or "cgroup /path (memory.max 4.0 GiB)"
    cgroup_limit: Optional[int] = None  # the cgroup's whole limit, when one applies


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" or not text.lstrip("-").isdigit() else int(text)


def _meminfo(key: str) -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_dir() -> Optional[tuple[Path, int]]:
    """(this process's memory cgroup folder, cgroup version), or None where none is readable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = CGROUP_ROOT / "memory" / path.lstrip("/")
            if folder.is_dir():
                return folder, 1
    for line in lines:
        if line.startswith("0::"):
            folder = CGROUP_ROOT / line[3:].lstrip("/")
            if (folder / "memory.max").exists():
                return folder, 2
    return None


def cgroup_limit_and_usage() -> Optional[tuple[Path, int, int]]:
    """(folder, limit, usage) of the innermost memory cgroup with a limit, walking up; None if unlimited."""
    found = cgroup_dir()
    if found is None:
        return None
    folder, version = found
    limit_file, usage_file = ("memory.limit_in_bytes", "memory.usage_in_bytes") if version == 1 else \
        ("memory.max", "memory.current")
    root = CGROUP_ROOT / "memory" if version == 1 else CGROUP_ROOT
    while True:
        limit = _read_int(folder / limit_file)
        if limit is not None and limit < UNLIMITED:
            return folder, limit, _read_int(folder / usage_file) or 0
        if folder == root or root not in folder.parents:
            return None
        folder = folder.parent


def limit() -> Limit:
    """What this process may still allocate: MemAvailable, or less where its cgroup leaves less."""
    available = _meminfo("MemAvailable") or _meminfo("MemTotal") or UNLIMITED
    cgroup = cgroup_limit_and_usage()
    if cgroup is not None:
        folder, cap, used = cgroup
        if cap - used < available:
            return Limit(cap - used, f"cgroup {folder} (limit {cap / (1 << 30):.2f} GiB, "
                                     f"{used / (1 << 30):.2f} GiB in use)", cap)
    return Limit(available, "MemAvailable", cgroup[1] if cgroup else None)


def process_limit() -> tuple[int, str]:
    """The most this process can ever hold, for a rank's report: an address-space limit (`ulimit -v`:
    virtual memory, which a torch process has GiBs more of than it has resident), else its cgroup's
    limit, else MemTotal."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        return soft, "the address-space limit of ulimit -v: virtual memory"
    cgroup = cgroup_limit_and_usage()
    if cgroup is not None:
        return cgroup[1], f"the memory cgroup's limit ({cgroup[0]})"
    return _meminfo("MemTotal") or 0, "the host's MemTotal"


def peak_rss(pid: str = "self") -> Optional[int]:
    """VmHWM: the process's peak resident memory so far."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def oom_kills() -> Optional[int]:
    """How many processes the kernel's OOM killer has ended: in this process's cgroup when it counts
    them (v2 memory.events, v1 memory.oom_control), else on the host (/proc/vmstat, Linux >= 4.13)."""
    found = cgroup_dir()
    if found is not None:
        folder, version = found
        name = "memory.oom_control" if version == 1 else "memory.events"
        count = _field(folder / name, "oom_kill")
        if count is not None:
            return count
    return _field(Path("/proc/vmstat"), "oom_kill")


def _field(path: Path, key: str) -> Optional[int]:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return None
