"""Options models for every recipe block.

Strategy, dataset and monitor blocks are plugins: each is a pydantic model with a
``name: Literal[...]`` tag and a ``component`` ClassVar naming the runtime implementation
("module:attr"), imported only when a run builds it. This module must stay light: it is what
``trainkit validate`` imports, and it must never import torch, DeepSpeed or MLflow.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt,
                      field_validator)


class Block(BaseModel):
    """Base of every recipe block: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PluginBlock(Block):
    """A block selected by its ``name`` from a plugin registry."""

    component: ClassVar[str] = ""


# --------------------------------------------------------------------------- model
class ModelSpec(Block):
    """`torchvision.<name>`, an import path `pkg.module:factory`, or a registered model plugin."""

    name: str = Field(description="torchvision.<model>, 'pkg.module:factory', or a registered model plugin name")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the model factory")
    weights: Optional[str] = Field(default=None, description="local state_dict file to load (never downloaded)")
    init: Literal["auto", "constructor", "seeded"] = Field(
        default="auto",
        description="initial weights: 'constructor' (the factory's own init; every rank builds the whole model), "
                    "'seeded' (built on the meta device, each rank fills only what it keeps, each parameter from "
                    "(seed, its module's name): identical across strategies and world sizes), 'auto' (seeded "
                    "for strategies that shard parameters -- FSDP, ZeRO-3 -- when every parameter can be "
                    "seeded and no weights file is given; constructor otherwise)")


# --------------------------------------------------------------------------- data
class DataOptions(PluginBlock):
    """DataLoader settings shared by every dataset. `batch_size` is per device."""

    batch_size: PositiveInt = Field(description="samples per device per micro-step")
    num_workers: NonNegativeInt = Field(default=0, description="DataLoader worker processes per rank")
    pin_memory: bool = Field(default=False, description="page-locked host memory (faster host-to-GPU copies)")
    prefetch_factor: Optional[PositiveInt] = Field(default=None, description="batches prefetched per worker")
    persistent_workers: bool = Field(default=False, description="keep workers alive across epochs")
    drop_last: bool = Field(default=True, description="drop the last incomplete batch of each epoch")
    shuffle: bool = Field(default=True, description="shuffle each epoch (DistributedSampler, seeded)")


class SyntheticData(DataOptions):
    """Deterministic random tensors: for smoke tests and framework-overhead benchmarks."""

    component: ClassVar[str] = "trainkit.runtime.data:build_synthetic"
    name: Literal["synthetic"]
    num_samples: PositiveInt = Field(default=1024, description="dataset length")
    shape: list[PositiveInt] = Field(default_factory=lambda: [3, 32, 32], min_length=1,
                                     description="shape of one input sample")
    num_classes: PositiveInt = Field(default=10, description="labels are drawn from [0, num_classes)")
    sleep_ms: NonNegativeFloat = Field(default=0.0, description="artificial per-sample latency (planted-fault tests)")


class ImageFolderData(DataOptions):
    """A folder of class sub-folders of JPEG/PNG images (the ImageNet layout)."""

    component: ClassVar[str] = "trainkit.runtime.data:build_imagefolder"
    name: Literal["imagefolder"]
    root: str = Field(description="training folder: ROOT/<class>/<image>")
    val_root: Optional[str] = Field(default=None, description="evaluation folder with the same layout")
    image_size: PositiveInt = Field(default=224, description="side of the square crop fed to the model")
    on_corrupt: Literal["error", "skip"] = Field(
        default="error", description="what to do with an unreadable image: fail, or skip it and count it"
    )


class Cifar10Data(DataOptions):
    """CIFAR-10 from a local folder holding `cifar-10-batches-py` (never downloaded)."""

    component: ClassVar[str] = "trainkit.runtime.data:build_cifar10"
    name: Literal["cifar10"]
    root: str = Field(description="folder containing cifar-10-batches-py/")


class TextCorpusOptions(Block):
    """A deterministic synthetic-language corpus written on first use (tests, docs, the LM demo)."""

    documents: PositiveInt = Field(default=2000, description="training documents (eval gets a tenth more)")
    seed: int = Field(default=0, description="corpus generator seed")
    vocab_size: PositiveInt = Field(default=512, ge=260, description="byte-level BPE vocabulary trained on it")


class TextData(DataOptions):
    """Local text (one document per line) or JSONL files, tokenized and packed into seq_len blocks."""

    component: ClassVar[str] = "trainkit.runtime.text_data:build_text"
    name: Literal["text"]
    files: list[str] = Field(min_length=1, description="training files (.txt: a document per line; .jsonl)")
    eval_files: list[str] = Field(default_factory=list, description="held-out files for eval perplexity")
    format: Literal["auto", "text", "jsonl"] = Field(default="auto", description="auto: .jsonl/.json is JSONL")
    text_field: str = Field(default="text", description="the JSONL field holding the text")
    tokenizer: str = Field(description="tokenizer.json of HF `tokenizers` (e.g. from `trainkit data train-tokenizer`)")
    seq_len: PositiveInt = Field(description="tokens per training sequence (inputs; targets are shifted by one)")
    generate: Optional[TextCorpusOptions] = Field(
        default=None, description="write a synthetic corpus and train its tokenizer when the files are missing")


# --------------------------------------------------------------------------- tasks
class TaskOptions(PluginBlock):
    """What a run learns: batch to device, the loss, logged/eval metrics and FLOPs (`runtime.protocols.Task`)."""


class ClassificationTaskOptions(TaskOptions):
    """Cross-entropy on (input, label) batches; eval loss and accuracy (the default task)."""

    component: ClassVar[str] = "trainkit.tasks.classification:ClassificationTask"
    name: Literal["classification"]


class CausalLMTaskOptions(TaskOptions):
    """Next-token prediction on (tokens, shifted tokens); loss, perplexity, tokens/s; eval perplexity."""

    component: ClassVar[str] = "trainkit.tasks.causal_lm:CausalLMTask"
    name: Literal["causal_lm"]
    ignore_index: int = Field(default=-100, description="target id that does not count (padding)")


# --------------------------------------------------------------------------- strategies
class StrategyOptions(PluginBlock):
    pass


class DDPOptions(StrategyOptions):
    """torch DistributedDataParallel: every rank holds the whole model; gradients are all-reduced."""

    component: ClassVar[str] = "trainkit.strategies.ddp:DDPStrategy"
    name: Literal["ddp"]
    bucket_cap_mb: PositiveFloat = Field(default=25.0, description="gradient bucket size for all-reduce")
    static_graph: bool = Field(default=False, description="the graph is the same every step (enables optimisations)")
    gradient_as_bucket_view: bool = Field(default=False, description="gradients alias the buckets (saves memory)")
    find_unused_parameters: bool = Field(default=False, description="tolerate parameters without gradients (slower)")
    comm_hook: Literal["none", "fp16_compress", "bf16_compress", "powersgd"] = Field(
        default="none", description="gradient compression hook"
    )
    powersgd_rank: PositiveInt = Field(default=1, description="matrix approximation rank for comm_hook: powersgd")


class FSDPOptions(StrategyOptions):
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across ranks."""

    component: ClassVar[str] = "trainkit.strategies.fsdp:FSDPStrategy"
    name: Literal["fsdp"]
    reshard_after_forward: bool = Field(default=True, description="free gathered parameters after forward")
    cpu_offload: bool = Field(default=False, description="keep sharded parameters on the CPU")
    wrap: list[str] = Field(default_factory=list, description="module class names sharded as units (empty: automatic)")
    activation_checkpointing: bool = Field(default=False, description="deprecated: use performance."
                                                                      "activation_checkpointing: full (recomputes "
                                                                      "the wrapped units)")


class PipelineOptions(StrategyOptions):
    """torch.distributed.pipelining: the model split into stages, one per rank."""

    component: ClassVar[str] = "trainkit.strategies.pipeline:PipelineStrategy"
    name: Literal["pipeline"]
    microbatches: PositiveInt = Field(default=4, description="micro-batches each batch is split into")
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(default="1f1b", description="pipeline schedule")
    split_points: list[str] = Field(
        default_factory=list, description="module names where a new stage begins (empty: balance by parameters)"
    )
    data_parallel: PositiveInt = Field(
        default=1, description="replicas of the whole pipeline, each reading its own share of the data (2-D: "
                               "world size = data_parallel x ranks per pipeline; gradients all-reduced per stage)")


class DeepSpeedOptions(StrategyOptions):
    """DeepSpeed ZeRO, launched under torchrun like every other strategy."""

    component: ClassVar[str] = "trainkit.strategies.deepspeed:DeepSpeedStrategy"
    name: Literal["deepspeed"]
    zero_stage: int = Field(default=3, ge=0, le=3, description="ZeRO stage 0-3")
    offload_optimizer: Literal["none", "cpu", "nvme"] = Field(default="none", description="optimizer state offload")
    offload_param: Literal["none", "cpu", "nvme"] = Field(default="none", description="parameter offload (stage 3)")
    config: dict[str, Any] = Field(default_factory=dict, description="passed through to the DeepSpeed config")


# --------------------------------------------------------------------------- monitors
class MonitorOptions(PluginBlock):
    # what the loop must measure for this monitor (off unless some enabled monitor asks)
    needs_forward_time: ClassVar[bool] = False
    needs_comm_time: ClassVar[bool] = False
    precise_timing: ClassVar[bool] = False  # CUDA events around the step phases


class SystemMonitorOptions(MonitorOptions):
    """CPU, memory, disk and network of the node (psutil), one sampler per node."""

    component: ClassVar[str] = "trainkit.monitors.system:SystemMonitor"
    name: Literal["system"]
    interval_s: PositiveFloat = Field(default=5.0, description="seconds between samples")


class GpuMonitorOptions(MonitorOptions):
    """GPU utilisation, memory, power and temperature via NVML."""

    component: ClassVar[str] = "trainkit.monitors.gpu:GpuMonitor"
    name: Literal["gpu"]
    interval_s: PositiveFloat = Field(default=5.0, description="seconds between samples")


class ThroughputMonitorOptions(MonitorOptions):
    """samples/s, step-time percentiles and MFU from counted FLOPs."""

    component: ClassVar[str] = "trainkit.monitors.throughput:ThroughputMonitor"
    name: Literal["throughput"]
    window: PositiveInt = Field(default=50, description="steps in the rolling window for percentiles")


class BreakdownMonitorOptions(MonitorOptions):
    """Per-step data-wait / forward / backward / optimizer times, gathered from all ranks."""

    component: ClassVar[str] = "trainkit.monitors.breakdown:BreakdownMonitor"
    needs_forward_time: ClassVar[bool] = True
    needs_comm_time: ClassVar[bool] = True
    precise_timing: ClassVar[bool] = True
    name: Literal["breakdown"]


class MemoryMonitorOptions(MonitorOptions):
    """Peak device memory (GPU) or RSS (CPU) per rank."""

    component: ClassVar[str] = "trainkit.monitors.memory:MemoryMonitor"
    name: Literal["memory"]
    snapshot: bool = Field(default=False, description="write a CUDA memory snapshot at the end")


class ProfilerMonitorOptions(MonitorOptions):
    """torch.profiler traces on a wait/warmup/active schedule."""

    component: ClassVar[str] = "trainkit.monitors.profiler:ProfilerMonitor"
    name: Literal["profiler"]
    wait: NonNegativeInt = Field(default=5, description="steps skipped before warming up")
    warmup: NonNegativeInt = Field(default=2, description="steps profiled but discarded")
    active: PositiveInt = Field(default=3, description="steps recorded")
    repeat: NonNegativeInt = Field(default=1, description="cycles (0: until the end)")
    ranks: list[NonNegativeInt] = Field(default_factory=lambda: [0], description="ranks that profile")


class StragglersMonitorOptions(MonitorOptions):
    """Flags ranks that arrive late at the gradient collective."""

    component: ClassVar[str] = "trainkit.monitors.stragglers:StragglersMonitor"
    needs_forward_time: ClassVar[bool] = True
    needs_comm_time: ClassVar[bool] = True
    precise_timing: ClassVar[bool] = True  # device time on a GPU: host time is only the kernels' launch
    name: Literal["stragglers"]
    every: PositiveInt = Field(default=10, description="steps between gathers")
    margin: PositiveFloat = Field(default=0.2, description="fraction slower than the median that counts as late")


class PrometheusMonitorOptions(MonitorOptions):
    """Live metrics for Prometheus (and the Grafana dashboard in docs/grafana-dashboard.json): an HTTP
    /metrics endpoint on each node's local rank 0."""

    component: ClassVar[str] = "trainkit.monitors.prometheus:PrometheusMonitor"
    name: Literal["prometheus"]
    port: int = Field(default=9464, ge=1, le=65535, description="TCP port of /metrics on every node")
    host: str = Field(default="127.0.0.1", description="address to bind (anything but loopback exposes the "
                                                       "metrics to the network, unauthenticated)")


class TensorBoardMonitorOptions(MonitorOptions):
    """Every logged scalar as TensorBoard events (RUN_DIR/tensorboard), beside MLflow."""

    component: ClassVar[str] = "trainkit.monitors.tensorboard:TensorBoardMonitor"
    name: Literal["tensorboard"]
    log_dir: Optional[str] = Field(default=None, description="event folder (default: RUN_DIR/tensorboard)")


# --------------------------------------------------------------------------- plain blocks
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
    monitor_interval: PositiveFloat = Field(default=1.0, description="seconds between agent health checks")
    backend: Literal["auto", "nccl", "gloo"] = Field(default="auto", description="auto: nccl with CUDA, else gloo")
    timeout_s: PositiveInt = Field(default=600, description="collective timeout")
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
    log_model: bool = Field(default=False, description="log the final model with mlflow.pytorch")
    log_checkpoints: bool = Field(default=False, description="upload checkpoints as artifacts")
    close_wait_s: float = Field(default=30.0, ge=0, description="at the end of a run, how long to keep retrying an "
                                "unreachable MLflow server (a restart rides it out) before leaving the records "
                                "in the spool for `trainkit sync`")
