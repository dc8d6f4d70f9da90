"""The plain (non-plugin) blocks: optimizer, scheduler, trainer, launch, performance, tracking."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, field_validator

from .base import Block


class SGDOptions(Block):
    name: Literal["sgd"]
    lr: PositiveFloat
    momentum: NonNegativeFloat = 0.0
    weight_decay: NonNegativeFloat = 0.0
    nesterov: bool = False


class AdamOptions(Block):
    name: Literal["adam", "adamw"]
    lr: PositiveFloat
    betas: tuple[float, float] = (0.9, 0.999)
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0


OptimizerOptions = Union[SGDOptions, AdamOptions]


class SchedulerOptions(Block):
    name: Literal["constant", "cosine", "linear", "step"] = Field(default="constant", description="decay shape")
    warmup_steps: NonNegativeInt = Field(default=0, description="linear warm-up from 0 to lr")
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0, description="final lr as a fraction of lr")
    step_size: Optional[PositiveInt] = Field(default=None, description="steps between decays (step only)")
    gamma: PositiveFloat = Field(default=0.1, description="decay factor (step only)")


class CheckpointOptions(Block):
    every: Optional[PositiveInt] = Field(default=None, description="steps between checkpoints (and always at the end)")
    keep: PositiveInt = Field(default=3, description="newest checkpoints retained")
    async_save: bool = Field(default=False, description="write checkpoints in the background: training blocks only "
                                                        "while the state is copied to host memory (DCP's async_save; ddp "
                                                        "and fsdp; docs/running.md, 'Checkpoints written in the "
                                                        "background')")


class TrainerOptions(Block):
    max_steps: PositiveInt = Field(description="optimizer steps to train")
    grad_accum_steps: PositiveInt = Field(default=1, description="micro-steps per optimizer step")
    grad_clip: Optional[PositiveFloat] = Field(default=None, description="max global gradient norm (null: off)")
    log_every: PositiveInt = Field(default=10, description="steps between metric logs")
    eval_every: Optional[PositiveInt] = Field(default=None, description="steps between evaluations (null: off)")
    eval_steps: PositiveInt = Field(default=10, description="batches per evaluation")
    checkpoint: CheckpointOptions = Field(default_factory=CheckpointOptions)
    resume: str = Field(default="auto", description="auto | never | path to a checkpoint folder")
    loss_scale: Union[Literal["dynamic"], PositiveFloat, None] = Field(
        default="dynamic", description="fp16 loss scaling: dynamic, a fixed scale, or null"
    )
    on_nonfinite: Literal["stop", "skip_step"] = Field(
        default="stop", description="a NaN/inf loss or gradient norm: stop (no device sync per step) or "
                                    "skip_step (discard that optimizer step; one device sync per step)")
    max_skipped_steps: PositiveInt = Field(default=10, description="skip_step: stop after this many skipped steps")


class LaunchOptions(Block):
    nproc_per_node: PositiveInt = Field(default=1, description="worker processes per node (one per GPU)")
    nnodes: Union[PositiveInt, str] = Field(default=1, description="nodes, or 'MIN:MAX' for elastic")
    cluster: Literal["auto", "none", "kubeflow", "trainjob", "slurm"] = Field(
        default="auto", description="auto: a PyTorchJob or TrainJob pod or a SLURM step sets nnodes, node_rank and the "
                                    "rendezvous (docs/clusters.md); none: only the recipe's values")
    node_rank: Optional[NonNegativeInt] = Field(default=None, description="static rendezvous only")
    max_restarts: NonNegativeInt = Field(default=0, description="group restarts after a worker failure")
    rdzv_backend: Literal["c10d", "static"] = Field(default="c10d", description="rendezvous backend")
    rdzv_endpoint: Optional[str] = Field(default=None, description="HOST:PORT of the rendezvous (multi-node)")
    rdzv_id: Optional[str] = Field(default=None, description="job id shared by all nodes")
    monitor_interval: PositiveFloat = Field(default=0.1, description="seconds between agent health checks "
                                                                      "(torchrun's default; a finished or failed worker is "
                                                                      "noticed within it)")
    backend: Literal["auto", "nccl", "gloo"] = Field(default="auto", description="auto: nccl with CUDA, else gloo")
    timeout_s: PositiveInt = Field(default=600, description="collective timeout")
    hang_timeout_s: Optional[PositiveFloat] = Field(
        default=None, description="a hang is declared when no rank makes progress for this long (docs/running.md, "
                                  "'When a run hangs'); null: 10x the slowest step seen, at least min(120, "
                                  "timeout_s / 2) seconds")
    join_timeout_s: PositiveInt = Field(
        default=600, description="several nodes: how long the agents wait for every node to join the rendezvous "
                                 "(torchrun's join_timeout); a node that never joins ends the launch after this, "
                                 "naming the missing nodes (docs/running.md, 'When a node does not join')")
    debug_collectives: bool = Field(
        default=False, description="torch's collective checks (TORCH_DISTRIBUTED_DEBUG=DETAIL): ranks calling "
                                   "different collectives or shapes fail at once, naming both sides "
                                   "(docs/running.md, 'When ranks desync'); slower: debugging only")
    run_dir: str = Field(default="runs", description="parent folder of run directories")

    @field_validator("nnodes", mode="before")
    @classmethod
    def _whole_number_text(cls, value: Any) -> Any:
        """`${oc.env:WORLD_SIZE}` interpolates to the text '3': a whole number is a number here too."""
        if isinstance(value, str) and value.strip().isdigit():
            return int(value.strip())
        return value


class CompileOptions(Block):
    """torch.compile settings (`performance.compile: true` is all defaults)."""

    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        default="default", description="torch.compile mode")
    fullgraph: bool = Field(default=False, description="fail on a graph break instead of falling back to eager")
    dynamic: Optional[bool] = Field(default=None, description="dynamic shapes: null lets torch decide")


class ActivationCheckpointingOptions(Block):
    """Recompute blocks' forwards in backward instead of keeping their activations."""

    mode: Literal["none", "full", "selective"] = Field(
        default="none", description="none | full (every block) | selective (every n-th block)")
    blocks: list[str] = Field(default_factory=list, description="block class names to checkpoint (empty: the "
                                                                "repeated children of Sequential/ModuleList containers)")
    every_n_blocks: PositiveInt = Field(default=1, description="selective: checkpoint blocks 0, n, 2n, ... (in "
                                                               "forward order)")


class PerformanceOptions(Block):
    """Speed settings. All are resume-safe (a checkpoint resumes with them changed); tf32 changes what the
    device computes (and so which peak MFU is measured against)."""

    tf32: bool = Field(default=False, description="fp32 matmuls and convolutions on TF32 tensor cores (Ampere and "
                                                  "later): faster, ~10 mantissa bits; false keeps true fp32")
    compile: Union[bool, CompileOptions] = Field(
        default=False, description="torch.compile: false | true | {mode, fullgraph, dynamic}; applied per "
                                   "strategy (before DDP wraps, per block before FSDP, per pipeline stage)")
    channels_last: bool = Field(default=False, description="NHWC memory format for the model and 4-D inputs "
                                                           "(faster convolutions on tensor cores and CPUs)")
    cudnn_benchmark: bool = Field(default=False, description="let cuDNN time convolution algorithms at the first "
                                                             "step (fixed input shapes only)")
    float8: bool = Field(default=False, description="the model's Linear layers compute their matmuls in float8 "
                                                    "(torchao's float8 training, dynamic scaling; precision bf16; "
                                                    "GPUs of compute capability 8.9+; the output head and layers "
                                                    "with a dimension not divisible by 16 stay bf16)")
    sync_batchnorm: bool = Field(default=False, description="ddp: BatchNorm statistics over the global batch "
                                                            "(one all-reduce per BatchNorm layer per step)")
    activation_checkpointing: Union[Literal["none", "full", "selective"], ActivationCheckpointingOptions] = Field(
        default="none", description="none | full | selective, or {mode, blocks, every_n_blocks}: recompute "
                                    "blocks in backward (less memory, ~1 extra forward)")
    host_allocator: Literal["auto", "retain", "release", "system"] = Field(
        default="auto", description="glibc malloc for host memory: retain keeps freed memory for reuse (fast: no "
                                    "page faults re-allocating each step's tensors; resident memory stays at its "
                                    "high-water mark), release returns blocks >= 1 MiB at once (lowest memory), "
                                    "system leaves glibc's defaults; auto on the CPU: the strategy's choice "
                                    "(retain for ddp and pipeline, release for fsdp and deepspeed); system on GPUs")

    # What a user turns each option on for (docs/compatibility.md, "Effects": measured where this machine
    # shows it; recipe.compatibility.effects)
    EFFECTS: ClassVar[dict[str, str]] = {
        "tf32": "step time of fp32 matmuls and convolutions (GPUs, Ampere and later)",
        "compile": "step time (fused kernels, fewer launches; GPUs)",
        "channels_last": "step time of convolutions (tensor cores, CPUs with oneDNN)",
        "cudnn_benchmark": "step time of convolutions (GPUs)",
        "float8": "step time of large matmuls (GPUs of compute capability 8.9+); under FSDP, its weights' "
                  "all-gather bytes halved (0.64x of all bytes on the test transformer, tests/test_float8.py)",
        "sync_batchnorm": "BatchNorm statistics over the global batch (what the model learns, not memory or speed)",
        "activation_checkpointing": "activations of recomputed blocks not held between forward and backward",
        "host_allocator": "host memory or step time (retain: no page faults; release: lowest resident memory)",
    }

    @property
    def compile_options(self) -> Optional[CompileOptions]:
        """The compile settings, or None when compile is off."""
        if self.compile is True:
            return CompileOptions()
        return self.compile or None

    @property
    def checkpointing(self) -> ActivationCheckpointingOptions:
        ac = self.activation_checkpointing
        return ac if isinstance(ac, ActivationCheckpointingOptions) else ActivationCheckpointingOptions(mode=ac)


class TrackingOptions(Block):
    experiment: str = Field(default="trainkit", description="MLflow experiment name")
    uri: Optional[str] = Field(default=None, description="MLflow tracking URI (null: embedded SQLite store)")
    run_name: Optional[str] = Field(default=None, description="MLflow run name (default: recipe name)")
    enabled: bool = Field(default=True, description="log to MLflow at all")
    log_model: bool = Field(default=False, description="log the final model to MLflow: a Hugging Face model (LoRA "
                                                          "merged) in the transformers flavour, any other with "
                                                          "mlflow.pytorch")
    log_checkpoints: bool = Field(default=False, description="upload checkpoints as artifacts")
    close_wait_s: float = Field(default=30.0, ge=0, description="at the end of a run, how long to keep retrying an "
                                "unreachable MLflow server (a restart rides it out) before leaving the records "
                                "in the spool for `trainkit sync`")
