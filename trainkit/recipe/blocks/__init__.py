"""Options models for every recipe block, one module per family and one per strategy.

Strategy, dataset, task and monitor blocks are plugins: each is a pydantic model with a
``name: Literal[...]`` tag and a ``component`` ClassVar naming the runtime implementation
("module:attr"), imported only when a run builds it. These modules must stay light: they are what
``trainkit validate`` imports, and they must never import torch, DeepSpeed or MLflow.

| family | module |
|---|---|
| bases (`Block`, `PluginBlock`) | `base.py` |
| `model:` | `model.py` |
| `data:` (datasets) | `data.py` |
| `task:` | `tasks.py` |
| `strategy:` base: capabilities, parallel dims, rules, plan lines, knobs | `strategy.py` |
| each strategy's options | `ddp.py`, `fsdp.py`, `pipeline.py`, `deepspeed.py` |
| `parallel:` (the device mesh) | `parallel.py` |
| `monitors:` | `monitors.py` |
| optimizer, scheduler, trainer, launch, performance, tracking | `training.py` |

Everything is re-exported here, so `from trainkit.recipe.blocks import DDPOptions` keeps working.
"""

from .base import Block, Finding, PluginBlock, PreflightFinding
from .data import (IMAGE_EXTENSIONS, Cifar10Data, DataOptions, ImageFolderData, SyntheticData, TextCorpusOptions,
                   TextData, scan_imagefolder)
from .ddp import DDPOptions
from .deepspeed import DeepSpeedOptions
from .fsdp import FSDPOptions
from .knobs import Knob
from .model import ModelSpec
from .monitors import (BreakdownMonitorOptions, GpuMonitorOptions, MemoryMonitorOptions, MonitorOptions,
                       ProfilerMonitorOptions, PrometheusMonitorOptions, StragglersMonitorOptions,
                       SystemMonitorOptions, TensorBoardMonitorOptions, ThroughputMonitorOptions)
from .parallel import ParallelOptions
from .pipeline import PipelineOptions
from .strategy import Capabilities, ParallelDims, StrategyOptions
from .tasks import CausalLMTaskOptions, ClassificationTaskOptions, TaskOptions
from .training import (ActivationCheckpointingOptions, AdamOptions, CheckpointOptions, CompileOptions, LaunchOptions,
                       OptimizerOptions, PerformanceOptions, SchedulerOptions, SGDOptions, TrackingOptions,
                       TrainerOptions)

__all__ = [
    "ActivationCheckpointingOptions",
    "AdamOptions",
    "Block",
    "BreakdownMonitorOptions",
    "Capabilities",
    "CausalLMTaskOptions",
    "CheckpointOptions",
    "Cifar10Data",
    "ClassificationTaskOptions",
    "CompileOptions",
    "DDPOptions",
    "DataOptions",
    "DeepSpeedOptions",
    "FSDPOptions",
    "Finding",
    "GpuMonitorOptions",
    "IMAGE_EXTENSIONS",
    "ImageFolderData",
    "Knob",
    "LaunchOptions",
    "MemoryMonitorOptions",
    "ModelSpec",
    "MonitorOptions",
    "OptimizerOptions",
    "ParallelDims",
    "ParallelOptions",
    "PerformanceOptions",
    "PipelineOptions",
    "PluginBlock",
    "PreflightFinding",
    "ProfilerMonitorOptions",
    "PrometheusMonitorOptions",
    "SGDOptions",
    "SchedulerOptions",
    "StragglersMonitorOptions",
    "StrategyOptions",
    "SyntheticData",
    "SystemMonitorOptions",
    "TaskOptions",
    "TensorBoardMonitorOptions",
    "TextCorpusOptions",
    "TextData",
    "ThroughputMonitorOptions",
    "TrackingOptions",
    "TrainerOptions",
    "scan_imagefolder",
]
