"""DataLoader workers against the cores this process may use: more worker processes than cores only
queue behind each other (torch warns per loader; the doctor counts every rank of the node)."""

from __future__ import annotations

from ..machine import usable_cores
from .check import Check, passed, warned


def data_workers(resolved) -> Check:
    name = "data workers"
    cores = usable_cores()
    if resolved is None:
        return passed(name, f"{cores} usable core(s); `trainkit doctor RECIPE` checks data.num_workers against them")
    r = resolved.recipe
    nproc, workers = r.launch.nproc_per_node, r.data.num_workers
    total = nproc * workers
    detail = f"{nproc} rank(s) x data.num_workers {workers} = {total} worker process(es) on {cores} usable core(s)"
    if total <= cores:
        return passed(name, detail)
    return warned(name, f"{detail}: more workers than cores only queue behind each other",
                  f"data.num_workers: {cores // nproc} ({resolved.locate(('data', 'num_workers'))})")
