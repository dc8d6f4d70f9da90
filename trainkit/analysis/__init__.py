"""What trainkit tells about a run from the files it wrote: the bottleneck diagnosis and its advice
(`bottleneck.py`, at the end of every run, `trainkit report`, `trainkit tune`), the evidence it reasons
from (`evidence.py`) and the live console view (`top.py`, `trainkit top`).

Not monitor plugins: monitors measure while a run trains (`trainkit/monitors`); this reads what they
and the run wrote. No torch at import.
"""
