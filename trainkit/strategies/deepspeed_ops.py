"""DeepSpeed's JIT-built CPU ops: say so before DeepSpeed spends a minute compiling one.

Why: on the CPU accelerator, DeepSpeed's comm backend loads its shared-memory collective op
(`ShareMemCommBuilder`, `deepspeed_shm_comm`) when the engine (or ZeRO-3's `zero.Init`) initializes
its communication. A pip-installed DeepSpeed ships it unbuilt (`installed_ops` says False), so the first
run on a machine JIT-compiles it through torch's C++ extension loader: about 30 s on 2 cores, with no
output (the loader is called with verbose=False). The result is cached in torch's extension folder
(`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions/<python>_<accelerator>/), so later runs
load it in well under a second. The README's set-up cannot build it at install time (it installs
DeepSpeed from a wheel, and `DS_BUILD_SHM_COMM=1` needs a source build), so trainkit says what is
happening instead, with the folder that keeps the result.

The same holds for DeepSpeed's CPU Adam (`CPUAdamBuilder`, `cpu_adam`), which optimizer offload steps
in: built on first use, about 60 s on 2 cores (AVX kernels), cached beside the comm op.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


COMM_OP = "ShareMemCommBuilder"
CPU_ADAM_OP = "CPUAdamBuilder"


def pending_build(builder_name: str = COMM_OP) -> Optional[Path]:
    """The folder a DeepSpeed op will be compiled into when its next use must build it first (op
    compatible, not prebuilt, not in torch's extension cache); else None. The conditions are
    DeepSpeed's own (`deepspeed.comm.torch.build_shm_op`, `OpBuilder.load`)."""
    from .deepspeed_import import import_deepspeed

    deepspeed = import_deepspeed()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder(builder_name)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None  # DeepSpeed uses gloo's collectives: nothing to build
    if installed_ops.get(builder.NAME, False):
        return None  # built when DeepSpeed was installed
    folder = Path(_get_build_directory(builder.NAME, verbose=False))  # where torch's loader builds and caches it
    return None if (folder / f"{builder.NAME}.so").is_file() else folder


def announce_build() -> bool:
    """On local rank 0 (the rank that keeps the console): the line saying the build is about to
    start and where its result stays, when it must be built. Returns whether it was printed."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return False
    folder = pending_build()
    if folder is None:
        return False
    print(f"trainkit: building DeepSpeed's CPU communication op (deepspeed_shm_comm; once per machine, "
          f"~30 s on 2 cores) into {folder}; later runs load it from there", flush=True)
    return True


def announce_cpu_adam_build() -> bool:
    """Like `announce_build`, for DeepSpeed's CPU Adam (optimizer offload)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return False
    folder = pending_build(CPU_ADAM_OP)
    if folder is None:
        return False
    print(f"trainkit: building DeepSpeed's CPU Adam (cpu_adam, for optimizer offload; once per machine, ~60 s on "
          f"2 cores) into {folder}; later runs load it from there", flush=True)
    return True
