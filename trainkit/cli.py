"""The `trainkit` command line.

Light at import time on purpose: `trainkit --help` and `trainkit validate` never import torch,
DeepSpeed or MLflow; each sub-command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
EXIT_LOST = 3  # `trainkit sync`: delivered, but a torn spool lost records (retrying will not bring them back)


def _positive(text: str) -> int:
    value = int(text) if text.lstrip("-").isdigit() else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    value = int(text) if text.isdigit() else -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number, 0 or more, got {text!r}")
    return value


def _positive_minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected minutes above 0 (fractions allowed, e.g. 0.5), got {text!r}")
    return value


OVERRIDES_HELP = ("override recipe values: key=value (any key the schema defines, e.g. trainer.max_steps=20), "
                  "+key=value (add a key under a free-form mapping such as model.args), ~key (delete a key, "
                  "e.g. one inherited from defaults:)")


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)


def _run_dir(text: str) -> Path:
    """RUN_DIR, or a run's name: its folder under the default launch.run_dir, where `trainkit run` puts it."""
    from .recipe.blocks.training import LaunchOptions

    named = Path(LaunchOptions.model_fields["run_dir"].default) / text
    return named if not Path(text).is_dir() and "/" not in text and named.is_dir() else Path(text)


def _command(sub, name: str, summary: str, description: str, examples: str) -> argparse.ArgumentParser:
    """A sub-command with a one-line summary (in `trainkit --help`), a description and examples."""
    return sub.add_parser(name, help=summary, description=description,
                          epilog="examples:\n" + "\n".join("  " + line for line in examples.strip().splitlines()),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _add_init(sub) -> None:
    p = _command(sub, "init", "write a new recipe from a few questions (or flags, for scripts)",
                 "Ask for the model, the data, GPUs per node, nodes, strategy, precision and tracking server "
                 "(each question has a default: press Enter), then write a commented recipe that validates. "
                 "Every answer can be given as a flag; --yes takes the defaults for the rest and asks nothing.",
                 """
trainkit init my-run.yaml
trainkit init my-run.yaml --yes --data synthetic --model mlp --gpus-per-node 2
trainkit init imagenet.yaml --yes --data /data/imagenet/train --model torchvision.resnet50 --gpus-per-node 8 \\
    --strategy fsdp --precision bf16 --tracking-uri http://mlflow:5000""")
    p.add_argument("out", metavar="OUT.yaml", help="the recipe file to write")
    p.add_argument("--name", help="run name (default: the file name)")
    p.add_argument("--model", help="mlp, small_cnn, torchvision.<name> or package.module:factory")
    p.add_argument("--data", help="'synthetic', or a folder: ImageFolder layout (ROOT/<class>/<image>) or one "
                                  "holding cifar-10-batches-py")
    p.add_argument("--batch-size", type=_positive, help="samples per device per step (default 32)")
    p.add_argument("--gpus-per-node", type=_positive, help="worker processes per node, one per GPU (1 on a CPU)")
    p.add_argument("--nodes", type=_positive, help="machines (default 1)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous endpoint, with several nodes")
    p.add_argument("--strategy", help="ddp, fsdp, deepspeed or pipeline")
    p.add_argument("--precision", help="fp32, bf16 or fp16")
    p.add_argument("--tracking-uri", help="MLflow server URI; '' for the local store, 'off' for no tracking")
    p.add_argument("--max-steps", type=_positive, help="optimizer steps (default 1000)")
    p.add_argument("-y", "--yes", action="store_true", help="ask nothing: defaults for every answer not given")
    p.add_argument("--force", action="store_true", help="overwrite OUT.yaml if it exists")
    p.set_defaults(func=cmd_init)


def _add_validate(sub) -> None:
    p = _command(sub, "validate", "check recipes (fast: no torch import; --deep for runtime checks)",
                 "Check recipe files, folders (recursive; base/ and _*.yaml fragments skipped) or globs: schema, "
                 "cross-field rules and plugin names, every problem as file:line:col. Overrides (key=value, "
                 "+key=value, ~key) may be mixed with the paths: they apply to each recipe. Exit 0 only if every "
                 "recipe is valid, 2 otherwise.",
                 """
trainkit validate recipes/
trainkit validate recipes/fsdp-mlp.yaml strategy.reshard_after_forward=false
trainkit validate recipes/ precision=bf16             # each recipe, with the override
trainkit validate --format github recipes/            # annotations in GitHub Actions
trainkit validate --deep recipes/resnet152.yaml       # also data paths, model, devices""")
    p.add_argument("paths", nargs="+", metavar="PATH|key=value",
                   help="recipe files, folders or globs, and overrides applied to each (" + OVERRIDES_HELP + ")")
    p.add_argument("--format", choices=["text", "json", "github"], default="text",
                   help="text for people, json for tools, github for Actions annotations")
    p.add_argument("--deep", action="store_true",
                   help="also run checks that import torch and the model's module (never other recipe code): model "
                        "exists and is a model factory, data paths, devices, DeepSpeed config")
    p.set_defaults(func=cmd_validate)


def _add_schema(sub) -> None:
    p = _command(sub, "schema", "print the recipe JSON Schema (for editor autocompletion)",
                 "Print the JSON Schema of recipes, with every installed plugin's options (for editors: see "
                 "docs/validation-in-ci.md), or with --markdown the recipe reference (docs/reference.md).",
                 """
trainkit schema > .vscode/trainkit.schema.json
trainkit schema --markdown > docs/reference.md
trainkit schema --markdown --all | less""")
    p.add_argument("--markdown", action="store_true", help="print the recipe reference (docs/reference.md) instead")
    p.add_argument("--all", action="store_true", help="with --markdown: include installed third-party plugins")
    p.set_defaults(func=cmd_schema)


def _add_plan(sub) -> None:
    p = _command(sub, "plan", "print the resolved recipe, what it implies, and the launch command",
                 "Resolve and check a recipe (including the checks --deep runs), then print the resolved recipe, "
                 "world size, global batch, steps per epoch, strategy details and what `trainkit run` will "
                 "start: the torchrun command, or the in-process worker for world size 1. Starts nothing.",
                 """
trainkit plan recipes/resnet152.yaml
trainkit plan recipes/ddp-mlp.yaml launch.nproc_per_node=4 trainer.max_steps=20
trainkit plan recipes/resnet152.yaml ~data.prefetch_factor""")
    p.add_argument("recipe", metavar="RECIPE")
    _add_overrides(p)
    p.set_defaults(func=cmd_plan)


def _add_run(sub) -> None:
    p = _command(sub, "run", "validate, then train under torchrun",
                 "Validate the recipe, run the preflight checks, then train: under torchrun for several processes, "
                 "in this process for one. The run directory is launch.run_dir/NAME; with trainer.resume: auto a "
                 "second `trainkit run` of the same recipe continues from its last checkpoint.",
                 """
trainkit run recipes/demo-cpu.yaml
trainkit run recipes/ddp-mlp.yaml trainer.max_steps=20 launch.nproc_per_node=2
trainkit run recipes/resnet152.yaml +model.args.dropout=0.1 ~trainer.eval_every
trainkit run recipes/ddp-mlp.yaml trainer.max_steps=200 --accept-changes   # resume with changed keys""")
    p.add_argument("recipe", metavar="RECIPE")
    p.add_argument("--accept-changes", action="store_true",
                   help="resume even though the recipe changed in keys that alter training (they take effect; "
                        "MLflow continues in a new linked run)")
    _add_overrides(p)
    p.set_defaults(func=cmd_run)


def _add_tune(sub) -> None:
    p = _command(sub, "tune", "measure the bottleneck advice as short real runs; write the recipe with only what "
                 "is proven faster",
                 "Measure the recipe as given (the baseline, with the breakdown monitor), build candidate changes "
                 "from its bottleneck diagnosis (data loading, DDP buckets and hooks, sharding, performance options; "
                 "batch size and precision only with --allow), run each as short real `trainkit run` trials "
                 "alternating with the baseline, keep a change only if its gain is significant (bootstrap 95% "
                 "interval of the paired throughput ratios above 1, and above the baseline's own noise), verify the "
                 "kept changes together, then write TUNED.yaml (the recipe with only the kept changes, each with "
                 "its measured gain) and TUNED.report.md. Exit 0 when done (with or without a change), 1 if the "
                 "baseline fails, 2 if refused. See docs/tune.md.",
                 """
trainkit tune recipes/ddp-mlp.yaml --budget 10
trainkit tune recipes/resnet50.yaml --knobs num_workers,prefetch_factor --steps 40 -o resnet50.tuned.yaml
trainkit tune recipes/ddp-mlp.yaml --allow batch,precision --budget 30
trainkit tune recipes/ddp-mlp.yaml launch.nproc_per_node=2 --knobs bucket_cap_mb,static_graph""")
    p.add_argument("recipe", metavar="RECIPE")
    _add_overrides(p)
    p.add_argument("--budget", type=_positive_minutes, default=15.0, metavar="MINUTES",
                   help="wall-clock minutes for all trials (may be fractional; default 15): respected to within one trial")
    p.add_argument("--steps", type=_positive, default=30, help="optimizer steps per trial (default 30; the first 2 "
                                                                "are warm-up and not measured)")
    p.add_argument("--knobs", metavar="a,b,c", help="knobs to try, whatever the diagnosis says (default: those the "
                                                   "diagnosis points at); knobs that do not apply are listed and skipped")
    p.add_argument("--allow", default="", metavar="batch,precision",
                   help="also try changes that alter training: batch (global batch, lr by the linear scaling rule), "
                        "precision (bf16, compressed gradients, tf32)")
    p.add_argument("-o", "--output", metavar="TUNED.yaml", help="the tuned recipe (default: RECIPE's name + "
                                                                ".tuned.yaml beside it); the report goes beside it")
    p.add_argument("--force", action="store_true", help="allow -o to overwrite the input recipe")
    p.set_defaults(func=cmd_tune)


def _add_doctor(sub) -> None:
    p = _command(sub, "doctor", "can this machine run it? versions, GPUs, ports, /dev/shm, limits, disk, data "
                 "(exit 1 if any check fails)",
                 "Check this machine, and with a recipe whether it can run that recipe here: versions, GPUs, "
                 "ports, /dev/shm, limits, disk, data. Exit 0 if nothing failed (warnings allowed), 1 if a check "
                 "failed, 2 if the recipe is invalid.",
                 """
trainkit doctor
trainkit doctor recipes/resnet152.yaml
trainkit doctor recipes/ddp-mlp.yaml launch.nproc_per_node=8 --format json""")
    p.add_argument("recipe", nargs="?", metavar="RECIPE", help="without it: machine-level checks only")
    _add_overrides(p)
    p.add_argument("--format", choices=["text", "json"], default="text", help="text for people, json for CI")
    p.set_defaults(func=cmd_doctor)


def _add_k8s(sub) -> None:
    p = _command(sub, "k8s", "write a Kubeflow PyTorchJob or Trainer v2 TrainJob (and the recipe's ConfigMap)",
                 "Write a ConfigMap holding the recipe and either a Kubeflow training-operator v1 PyTorchJob (Master "
                 "+ Workers, restartPolicy OnFailure; --api pytorchjob, the default) or a Kubeflow Trainer v2 "
                 "TrainJob referencing a ClusterTrainingRuntime (--api trainjob; --with-runtime also writes "
                 "trainkit's runtime, installed once per cluster). MLflow credentials come only from a referenced "
                 "Secret. See docs/clusters.md.",
                 """
trainkit k8s recipes/resnet152.yaml launch.nnodes=4 --image registry/trainkit:latest --run-dir-pvc runs -o job.yaml
trainkit k8s recipes/resnet152.yaml --image registry/trainkit:latest --apply
trainkit k8s recipes/resnet152.yaml launch.nnodes=4 --api trainjob --image registry/trainkit:latest --with-runtime
trainkit k8s recipes/resnet152.yaml --api trainjob --runtime torch-distributed --image registry/trainkit:latest""")
    p.add_argument("recipe", metavar="RECIPE")
    _add_overrides(p)
    p.add_argument("--image", required=True, help="container image with trainkit installed")
    p.add_argument("--api", default="pytorchjob", metavar="API",
                   help="pytorchjob (kubeflow.org/v1, training operator; default) or trainjob "
                        "(trainer.kubeflow.org/v1alpha1, Kubeflow Trainer v2)")
    p.add_argument("--runtime", metavar="NAME", help="trainjob: the ClusterTrainingRuntime to reference (default "
                                                      "trainkit-distributed; torch-distributed is Kubeflow's own)")
    p.add_argument("--with-runtime", action="store_true",
                   help="trainjob: also write trainkit's ClusterTrainingRuntime (install it once per cluster)")
    p.add_argument("--namespace", help="Kubernetes namespace")
    p.add_argument("--gpus-per-node", type=int, help="nvidia.com/gpu per pod, 0 for CPU nodes (default: nproc_per_node with nccl, none with gloo; required with backend auto)")
    p.add_argument("--run-dir-pvc", metavar="NAME", help="PersistentVolumeClaim for the run directory (shared storage)")
    p.add_argument("--mlflow-secret", default="mlflow-credentials", metavar="NAME",
                   help="Secret with the MLflow username/password keys (referenced, never inlined)")
    p.add_argument("--rdma-resource", action="append", default=[], metavar="NAME[=COUNT]",
                   help="an RDMA device plugin's resource per pod, e.g. rdma/hca_shared_devices_a=1 (repeatable): "
                        "requested and limited, with the IPC_LOCK capability")
    p.add_argument("--network", action="append", default=[], metavar="NAME",
                   help="a secondary network each pod attaches (Multus' k8s.v1.cni.cncf.io/networks annotation), e.g. "
                        "the RDMA network your network operator defines (repeatable; NAMESPACE/NAME allowed)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the manifest here (default: stdout)")
    p.add_argument("--dry-run", action="store_true", help="print the manifest only, even with --apply")
    p.add_argument("--apply", action="store_true", help="kubectl apply it (needs kubectl on PATH)")
    p.set_defaults(func=cmd_k8s)


def _add_slurm(sub) -> None:
    p = _command(sub, "slurm", "write an sbatch script that runs a recipe on a SLURM allocation",
                 "Write an sbatch script: one srun task per node runs `trainkit run`, which starts the local "
                 "workers; the rendezvous is the allocation's first node; --requeue plus resume: auto continue "
                 "a preempted job. See docs/clusters.md.",
                 """
trainkit slurm recipes/resnet152.yaml launch.nnodes=2 --partition gpu --time 24:00:00 -o train.sbatch
sbatch train.sbatch""")
    p.add_argument("recipe", metavar="RECIPE")
    _add_overrides(p)
    p.add_argument("--partition", help="#SBATCH --partition")
    p.add_argument("--time", help="#SBATCH --time, e.g. 24:00:00")
    p.add_argument("--gpus-per-node", type=int, help="#SBATCH --gpus-per-node, 0 for CPU nodes (default: nproc_per_node with nccl, none with gloo; required with backend auto)")
    p.add_argument("--cpus-per-task", type=int, help="#SBATCH --cpus-per-task")
    p.add_argument("--mem", default="auto", metavar="auto|none|SIZE",
                   help="#SBATCH --mem: auto (default) the node's need from the memory plan (docs/clusters.md), "
                        "none to leave it to the site's default, or a size such as 200G")
    p.add_argument("-o", "--output", metavar="FILE", help="write the script here (default: stdout)")
    p.set_defaults(func=cmd_slurm)


def _add_export(sub) -> None:
    p = _command(sub, "export", "write a checkpoint's model as one consolidated state_dict file (any strategy)",
                 "Consolidate a checkpoint written by any strategy (DDP, FSDP, DeepSpeed, pipeline) into one "
                 "state_dict file that torch.load and model.load_state_dict read; with --hf, a Hugging Face "
                 "model's checkpoint as a directory from_pretrained reads (LoRA adapters merged in).",
                 """
trainkit export runs/ddp-mlp/checkpoints/step-00000100 ddp-mlp.pt
trainkit export runs/llama-lora/checkpoints/step-00001000 llama-tuned --hf""")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="e.g. runs/NAME/checkpoints/step-00000100")
    p.add_argument("out", metavar="OUT", help="file for torch.load + model.load_state_dict (with --hf: a new directory)")
    p.add_argument("--hf", action="store_true",
                   help="write a Hugging Face model directory (config.json, model.safetensors, the pretrained "
                        "directory's tokenizer files), LoRA adapters merged into the weights")
    p.set_defaults(func=cmd_export)


def _add_runs(sub) -> None:
    p = _command(sub, "runs", "list recent runs in the MLflow store",
                 "List recent runs of the MLflow tracking store: id, name, status, start, key metrics.",
                 """
trainkit runs
trainkit runs --experiment resnet152 --limit 5
trainkit runs --uri http://mlflow:5000""")
    p.add_argument("--uri", help="tracking URI (default: MLFLOW_TRACKING_URI, else the project's mlflow.db: docs/tracking.md)")
    p.add_argument("--experiment", help="only this experiment")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--all", action="store_true", help="also list attempts superseded by a later run of the job")
    p.set_defaults(func=cmd_runs)


def _add_compare(sub) -> None:
    p = _command(sub, "compare", "side-by-side table of runs: differing params, final/best metrics",
                 "Compare runs side by side: the parameters that differ and each metric's final and best value.",
                 """
trainkit compare 3f2a 9b1c
trainkit compare resnet152-ddp resnet152-fsdp --uri http://mlflow:5000""")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run ids (or unique prefixes) or run names")
    p.add_argument("--uri", help="tracking URI (default: MLFLOW_TRACKING_URI, else the project's mlflow.db: docs/tracking.md)")
    p.set_defaults(func=cmd_compare)


def _add_ui(sub) -> None:
    p = _command(sub, "ui", "start the MLflow UI on the tracking store (loopback by default)",
                 "Start the MLflow UI on the tracking store. It binds 127.0.0.1 unless told otherwise: the MLflow "
                 "UI has no authentication.",
                 """
trainkit ui
trainkit ui --port 5001
ssh -L 5000:127.0.0.1:5000 gpu-node   # then, on gpu-node: trainkit ui""")
    p.add_argument("--uri", help="tracking URI (default: MLFLOW_TRACKING_URI, else the project's mlflow.db: docs/tracking.md)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; the MLflow UI has no authentication)")
    p.add_argument("--port", type=int, default=5000)
    p.set_defaults(func=cmd_ui)


def _add_sync(sub) -> None:
    p = _command(sub, "sync", "deliver a run's spooled tracking records (after a server outage)",
                 "Deliver the tracking records a run spooled while its MLflow server was unreachable; a run whose "
                 "launch died without closing it is closed too (FINISHED if it completed, else KILLED). A spool "
                 "torn by a crash is reported (what it lost) and repaired from the run directory. Exit 1 if "
                 "records are still pending, 2 if a folder has no spool, 3 if a torn spool lost records.",
                 """
trainkit sync runs/resnet152-ddp
trainkit sync runs/ddp-mlp.tune-20261122-101500/parent runs/ddp-mlp.tune-20261122-101500/trials/*""")
    p.add_argument("run_dirs", metavar="RUN_DIR", nargs="+")
    p.set_defaults(func=cmd_sync)


def _add_report(sub) -> None:
    p = _command(sub, "report", "the bottleneck report of a past run (from RUN_DIR/reports/breakdown.json)",
                 "Print the bottleneck report of a finished run (needs the breakdown monitor): where step time "
                 "went and what to change.",
                 """
trainkit report runs/resnet152-ddp
trainkit report resnet152-ddp        # a run's name: its folder under runs/ (launch.run_dir's default)""")
    p.add_argument("run_dir", metavar="RUN_DIR|NAME", type=_run_dir)
    p.set_defaults(func=cmd_report)


def _add_top(sub) -> None:
    p = _command(sub, "top", "live view of a training run: per-rank step phases, CPU/GPU, memory",
                 "Show a run while it trains, refreshed from its files (metrics.jsonl, live/breakdown.json): step, "
                 "loss, samples/s, every rank's step time, data wait and phases (`breakdown` monitor), CPU and "
                 "memory per node (`system`), GPU utilisation and memory per rank (`gpu`). Works from any shell "
                 "that sees the run directory; exits when the run finishes.",
                 """
trainkit top runs/resnet152-ddp
trainkit top runs/resnet152-ddp --once        # one frame, e.g. for a log
trainkit top resnet152-ddp                    # a run's name: its folder under runs/""")
    p.add_argument("run_dir", metavar="RUN_DIR|NAME", type=_run_dir)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(func=cmd_top)


def _add_plugins(sub) -> None:
    p = _command(sub, "plugins", "list installed plugins, or scaffold a new one (plugins new KIND NAME)",
                 "Without arguments: every installed model, dataset, strategy and monitor plugin with the package "
                 "it comes from, its entry point and its options (warning about options modules that import torch "
                 "at module level: they slow `trainkit validate`). `plugins KIND` lists one kind. `plugins new "
                 "KIND NAME` writes an installable package trainkit-NAME with a passing test (docs/plugins.md).",
                 """
trainkit plugins
trainkit plugins monitors
trainkit plugins new monitor step_alarm --dir ~/src   # then: .venv/bin/pip install ~/src/trainkit-step-alarm""")
    p.add_argument("action", nargs="*", metavar="[KIND] | new KIND NAME",
                   help="a kind to list (model, dataset, strategy, monitor), or `new KIND NAME`")
    p.add_argument("--dir", default=".", help="where `new` writes the package (default: here)")
    p.set_defaults(func=cmd_plugins)


def _add_completion(sub) -> None:
    p = _command(sub, "completion", "print a shell completion script (bash, zsh or fish)",
                 "Print a completion script for commands, options, recipe paths, and override keys and values "
                 "from the schema (including installed plugins).",
                 """
eval "$(trainkit completion bash)"                          # in ~/.bashrc
trainkit completion zsh > "${fpath[1]}/_trainkit"           # zsh (then restart it)
trainkit completion fish > ~/.config/fish/completions/trainkit.fish""")
    p.add_argument("shell", choices=["bash", "zsh", "fish"])
    p.set_defaults(func=cmd_completion)


def _add_bench(sub) -> None:
    p = _command(sub, "bench", "benchmarks: scaling over world sizes",
                 "Benchmarks. scaling runs a recipe (or a hand-written torchrun script) at each world size with the "
                 "batch per process fixed (weak scaling) and writes a table and a speedup plot.",
                 """
trainkit bench scaling recipes/resnet152-ddp.yaml --nproc 1,2,4,8""")
    bench_sub = p.add_subparsers(dest="bench_command", metavar="ACTION", required=True)
    b = _command(bench_sub, "scaling", "throughput, speedup and efficiency at several world sizes, with a plot",
                 "Run RECIPE with launch.nproc_per_node set to each of --nproc in turn (one node; weak scaling: "
                 "data.batch_size per process fixed) and measure the median step time of the steps after "
                 "--warmup. Writes scaling.json, scaling.md (samples/s, speedup, efficiency) and scaling.png "
                 "(measured speedup vs ideal, and --reference) to --out (default RUN_DIR/NAME-scaling) and logs "
                 "them to MLflow. With --script, runs that torchrun script instead: it gets --steps, --log-every 1, "
                 "--batch and --out FILE and writes {\"times\": {step: unix time}} to FILE (see bench/plain_ddp.py).",
                 """
trainkit bench scaling recipes/ddp-mlp.yaml --nproc 1,2 --steps 30
trainkit bench scaling recipes/resnet152-ddp.yaml --nproc 1,2,4,8 --reference 1:1,2:1.8,4:3.5,8:6.2,16:11.0
trainkit bench scaling --script bench/plain_ddp.py --nproc 1,2 --batch 32""")
    b.add_argument("recipe", nargs="?", metavar="RECIPE", help="recipe file (omit with --script)")
    b.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides")
    b.add_argument("--nproc", default="1,2", help="comma-separated world sizes (default 1,2)")
    b.add_argument("--steps", type=_positive, default=30, help="optimizer steps per world size (default 30)")
    b.add_argument("--warmup", type=int, default=5, help="first steps left out of the median (default 5)")
    b.add_argument("--script", help="a hand-written torchrun script to measure instead of a recipe")
    b.add_argument("--batch", type=_positive, help="--script: batch per process (default 32)")
    b.add_argument("--reference", help="reference speedups to plot, N:SPEEDUP,... (e.g. 1:1,2:1.8,4:3.5)")
    b.add_argument("--reference-label", default="reference", help="legend label of --reference")
    b.add_argument("--out", help="output folder")
    b.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    b.set_defaults(func=cmd_bench_scaling)


def _add_data(sub) -> None:
    p = _command(sub, "data", "data helpers",
                 "Data helpers. make-imagefolder writes a small synthetic ImageFolder of real image files, to try a "
                 "recipe before the real data is there.",
                 """
trainkit data make-imagefolder data/demo-imagefolder --classes 8 --per-class 40 --size 72""")
    data_sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    m = _command(data_sub, "make-imagefolder", "write a small synthetic ImageFolder of real image files",
                 "Write CLASSES folders of PER_CLASS PNG images each (deterministic for a seed) under DIR.",
                 """
trainkit data make-imagefolder /tmp/imagenet/train --classes 10 --per-class 50""")
    m.add_argument("root", metavar="DIR")
    m.add_argument("--classes", type=_positive, default=10)
    m.add_argument("--per-class", type=_positive, default=50)
    m.add_argument("--size", type=_positive, default=64)
    m.add_argument("--seed", type=_non_negative, default=0)
    m.add_argument("--val-per-class", type=_non_negative, default=0, metavar="N",
                   help="also write N held-out images per class: DIR/train/ and DIR/val/ (default 0: DIR/<class>/)")
    m.set_defaults(func=cmd_make_imagefolder)
    m = data_sub.add_parser("make-corpus", help="write a synthetic-language text corpus (train.txt, eval.txt)")
    m.add_argument("folder", metavar="DIR")
    m.add_argument("--documents", type=_positive, default=2000, help="training documents (eval: a tenth)")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_make_corpus)
    m = data_sub.add_parser("make-chat-demo", help="write a stand-in chat model directory and SFT data (the LoRA "
                                                   "demo's: recipes/lora-sft-demo-cpu.yaml)")
    m.add_argument("folder", metavar="DIR")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_make_chat_demo)
    m = data_sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer (tokenizers) on text/JSONL files")
    m.add_argument("files", metavar="FILE", nargs="+")
    m.add_argument("--out", required=True, metavar="TOKENIZER_JSON")
    m.add_argument("--vocab-size", type=_positive, default=8192)
    m.add_argument("--text-field", default="text", help="the JSONL field holding the text")
    m.add_argument("--min-frequency", type=_positive, default=2)
    m.set_defaults(func=cmd_train_tokenizer)


def build_parser() -> argparse.ArgumentParser:
    """The `trainkit` parser: each command's options, description and examples live in its `_add_<command>`."""
    parser = argparse.ArgumentParser(
        prog="trainkit",
        description="One YAML recipe -> a correct, fast, observable distributed PyTorch training run.",
        epilog="examples:\n  trainkit init my-run.yaml\n  trainkit validate recipes/\n"
               "  trainkit plan recipes/ddp-mlp.yaml trainer.max_steps=20\n  trainkit run recipes/ddp-mlp.yaml\n"
               "  trainkit COMMAND --help      (each command's options and examples)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_init(sub)
    _add_validate(sub)
    _add_schema(sub)
    _add_plan(sub)
    _add_run(sub)
    _add_tune(sub)
    _add_doctor(sub)
    _add_k8s(sub)
    _add_slurm(sub)
    _add_export(sub)
    _add_runs(sub)
    _add_compare(sub)
    _add_ui(sub)
    _add_sync(sub)
    _add_report(sub)
    _add_top(sub)
    _add_plugins(sub)
    _add_completion(sub)
    _add_bench(sub)
    _add_data(sub)
    return parser


# ----------------------------------------------------------------------------- commands
def cmd_validate(args: argparse.Namespace) -> int:
    from .recipe import RecipeError, resolve
    from .recipe.discovery import expand_recipe_paths, split_overrides
    from .recipe.problems import Location, Problem, format_problems

    paths, overrides = split_overrides(args.paths)
    if not paths:
        print(f"trainkit: validate: no recipe given, only overrides ({' '.join(overrides)}); name recipe files, "
              "folders or globs too", file=sys.stderr)
        return EXIT_INVALID
    files, missing = expand_recipe_paths(paths)
    problems: list[Problem] = [Problem(Location(m), "", "no such file, folder or matching recipe") for m in missing]
    invalid = len(missing)
    for file in files:
        try:
            resolved = resolve(file, overrides)
            found = _tracking_warnings(resolved) + (_deep_problems(resolved) if args.deep else [])
        except RecipeError as err:
            found = err.problems
        if len(files) > 1:  # an override's or a shared fragment's problem is one per recipe: say which
            found = [_naming_recipe(p, file) for p in found]
        if any(p.severity == "error" for p in found):
            invalid += 1
        problems.extend(found)
    if args.format == "text":
        if problems:
            print(format_problems(problems), file=sys.stderr)
        total = len(files) + len(missing)
        each = " applied to each" if total > 1 else ""
        print(f"{total - invalid} of {total} recipe(s) valid"
              + (f" with the override(s) {' '.join(overrides)}{each}" if overrides else "")
              + ("" if args.deep else " (not checked without --deep, which imports the model's module: model "
                 "exists and is a model factory, data paths, devices, DeepSpeed config)"))
    else:
        print(format_problems(problems, args.format))
    return EXIT_INVALID if invalid else EXIT_OK


def _naming_recipe(problem, recipe: str):
    """`problem` of `recipe`, saying so where its location does not (an override, a `defaults:` file)."""
    from .recipe.problems import COMMAND_LINE, Location, Problem

    where = problem.location
    if where.override is not None:
        return Problem(Location(recipe, override=where.override), problem.path, problem.message, problem.severity)
    if where.file != COMMAND_LINE and Path(where.file).resolve() != Path(recipe).resolve():
        return Problem(where, problem.path, f"{problem.message} (recipe {recipe})", problem.severity)
    return problem


def _tracking_warnings(resolved) -> list:
    """A warning when the recipe's tracking server is not the one the environment's MLflow credentials
    belong to: they are not sent to it (tracking/credentials.py)."""
    from .recipe.problems import Problem
    from .tracking import credentials

    tracking = resolved.recipe.tracking
    why = credentials.withheld(tracking.uri) if tracking.enabled and tracking.uri else None
    return [Problem(resolved.locate(("tracking", "uri")), "tracking.uri", resolved.redact_text(why), "warning")] \
        if why else []


def _deep_problems(resolved) -> list:
    """Checks that need torch and the filesystem: run by `plan` and `validate --deep`."""
    from .runtime import preflight

    return resolved.redact_problems(preflight.check(resolved))


def cmd_schema(args: argparse.Namespace) -> int:
    if args.markdown:
        from .recipe.reference import reference_markdown

        print(reference_markdown(builtin_only=not args.all))
        return EXIT_OK
    import json

    from .recipe.json_schema import recipe_json_schema

    print(json.dumps(recipe_json_schema(), indent=2))
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from .recipe import RecipeError, resolve
    from .recipe.plan import describe

    resolved = resolve(args.recipe, args.overrides)
    problems = _deep_problems(resolved)
    # a plan is often made where the data is not (a laptop, CI, before the corpus is copied): what is
    # missing under `data:` is listed as such after the plan, which needs only the data's shape;
    # `run` and `validate --deep` still refuse it
    errors = [p for p in problems if p.severity == "error" and not _data_problem(p)]
    if errors:
        raise RecipeError(errors)
    from .doctor.resources import memory_verdict
    from .recipe.plan import memory_lines

    print(describe(resolved, args.recipe, args.overrides, memory_lines(memory_verdict(resolved.recipe))))
    missing_data = [p for p in problems if p.severity == "error" and _data_problem(p)]
    for p in problems:
        if p not in missing_data:
            print(p, file=sys.stderr)
    if missing_data:
        print(f"data not on this machine ({len(missing_data)}): `run` refuses to start until these are fixed",
              file=sys.stderr)
        for p in missing_data:
            print(f"  {p}", file=sys.stderr)
    return EXIT_OK


def _data_problem(problem) -> bool:
    """A data file or folder the recipe names that is not on this machine (preflight's "... not found"
    under `data:`), which `plan` reports without stopping. Data that is there but wrong (a pickle that
    would run code, a record without its field) still stops it."""
    return (problem.path == "data" or problem.path.startswith("data.")) and " not found" in problem.message


def cmd_run(args: argparse.Namespace) -> int:
    from .console import survive_closed_output
    from .recipe import resolve

    survive_closed_output()  # `trainkit run ... | head`: the run trains to the end when its reader leaves

    resolved = resolve(args.recipe, args.overrides)
    from .launch import launcher

    code = launcher.run(resolved, args.recipe, list(args.overrides), accept_changes=args.accept_changes)
    if code > 128:  # stopped by a signal, the stop reported: leave within the grace the stop promised --
        sys.stdout.flush()  # a background checkpoint write still running after its bounded wait is DCP's
        sys.stderr.flush()  # non-daemon thread, which the interpreter's exit would join (its folder stays
        os._exit(code)  # unsealed, never taken for a checkpoint)
    return code


def cmd_tune(args: argparse.Namespace) -> int:
    from .recipe import resolve

    resolved = resolve(args.recipe, args.overrides)  # an invalid recipe: the usual messages, exit 2
    from .launch import tune

    recipe = Path(args.recipe)
    out = Path(args.output) if args.output else recipe.with_name(recipe.stem + ".tuned.yaml")
    split = lambda text: [w.strip() for w in (text or "").split(",") if w.strip()]  # noqa: E731
    options = tune.Options(budget_s=args.budget * 60, steps=args.steps,
                           knobs=split(args.knobs) if args.knobs else None, out=out, allow=frozenset(split(args.allow)))
    return tune.tune(resolved, args.recipe, list(args.overrides), options, force=args.force)


def cmd_doctor(args: argparse.Namespace) -> int:
    """Exit 0: nothing failed (warnings allowed); 1: some check failed; 2: the recipe is invalid."""
    from . import doctor

    resolved = None
    if args.recipe:
        from .recipe import resolve

        from .recipe import RecipeError
        from .runtime.preflight import model_problems

        resolved = resolve(args.recipe, args.overrides)
        errors = [p for p in resolved.redact_problems(model_problems(resolved)) if p.severity == "error"]
        if errors:  # the factory rule first: nothing a recipe names is built unless it is a model factory
            raise RecipeError(errors)
    checks = doctor.run_checks(resolved)
    if args.format == "json":
        out = doctor.as_json(checks, args.recipe)
    else:
        out = doctor.table(checks, f"trainkit doctor: {args.recipe or 'this machine (no recipe)'}")
    print(resolved.redact_text(out) if resolved else out)
    return EXIT_FAILED if doctor.exit_code(checks) else EXIT_OK


def _write_or_print(text: str, output: Optional[str]) -> None:
    if output:
        with open(output, "w") as fh:
            fh.write(text)
        print(f"trainkit: wrote {output}", file=sys.stderr)
    else:
        print(text, end="")


def cmd_k8s(args: argparse.Namespace) -> int:
    import shutil
    import subprocess

    from .cluster.k8s import APIS, K8sError, check_names, check_networks, gpus_for, pytorchjob, trainjob
    from .cluster.node_resources import parse_rdma
    from .recipe import resolve
    from .recipe.problems import did_you_mean

    if args.api not in APIS:
        print(f"trainkit: --api {args.api!r} is not a Kubeflow API trainkit writes: choose "
              f"{' or '.join(APIS)}{did_you_mean(args.api.lower(), APIS)}", file=sys.stderr)
        return EXIT_INVALID
    if args.api != "trainjob" and (args.runtime or args.with_runtime):
        print(f"trainkit: --runtime and --with-runtime are for --api trainjob (a PyTorchJob references no "
              f"runtime)", file=sys.stderr)
        return EXIT_INVALID
    try:  # names Kubernetes would reject, before the recipe is read
        check_names(namespace=args.namespace, run_dir_pvc=args.run_dir_pvc, mlflow_secret=args.mlflow_secret,
                    runtime=args.runtime)
        rdma = parse_rdma(args.rdma_resource, K8sError)
        check_networks(args.network)
    except K8sError as err:
        print(f"trainkit: {err}; nothing written", file=sys.stderr)
        return EXIT_INVALID
    if args.gpus_per_node is not None and args.gpus_per_node < 0:
        print("trainkit: --gpus-per-node must be 0 or more", file=sys.stderr)
        return EXIT_INVALID
    resolved = resolve(args.recipe, args.overrides)
    try:
        resources = _node_resources(resolved.recipe, gpus_for(resolved.recipe.launch, args.gpus_per_node), rdma)
        common = dict(image=args.image, namespace=args.namespace, gpus_per_node=args.gpus_per_node,
                      run_dir_pvc=args.run_dir_pvc, mlflow_secret=args.mlflow_secret, resources=resources,
                      networks=args.network)
        if args.api == "trainjob":
            manifest = trainjob(resolved, args.recipe, runtime=args.runtime, with_runtime=args.with_runtime, **common)
        else:
            manifest = pytorchjob(resolved, args.recipe, **common)
    except K8sError as err:
        print(f"trainkit: {err}; nothing written", file=sys.stderr)
        return EXIT_INVALID
    for note in manifest.notes:
        print(f"trainkit: note: {note}", file=sys.stderr)
    _write_or_print(manifest.text(), args.output)
    if args.apply and not args.dry_run:
        if not shutil.which("kubectl"):
            print("trainkit: --apply needs kubectl on PATH; apply the manifest yourself: kubectl apply -f FILE",
                  file=sys.stderr)
            return EXIT_INVALID
        return subprocess.run(["kubectl", "apply", "-f", "-"], input=manifest.text(), text=True).returncode
    return EXIT_OK


def _node_resources(recipe, gpus: int, rdma: Optional[dict] = None):
    """What each node (pod, SLURM node) asks for (trainkit/cluster/node_resources.py): its CPUs, and memory
    and /dev/shm from the memory plan's host memory per rank and the DataLoader's shared memory (doctor's
    estimates)."""
    from .cluster.gpus import nproc_for
    from .cluster.node_resources import node_resources
    from .doctor.resources import host_memory_per_rank, shm_need

    nproc = nproc_for(recipe.launch, gpus)
    host = host_memory_per_rank(recipe, "cuda" if gpus else "cpu")
    shm = shm_need(recipe, nproc)
    return node_resources(recipe, nproc, host_per_rank=host and host[0], shm_need=shm and shm[0], rdma=rdma,
                          host_how=host[1] if host else "")


def cmd_slurm(args: argparse.Namespace) -> int:
    from .cluster.gpus import gpus_per_node
    from .cluster.slurm import SlurmError, sbatch_script
    from .recipe import resolve

    resolved = resolve(args.recipe, args.overrides)
    try:
        gpus = gpus_per_node(resolved.recipe.launch, args.gpus_per_node, SlurmError)
        resources = _node_resources(resolved.recipe, gpus)
        script = sbatch_script(resolved, args.recipe, args.overrides, partition=args.partition, time=args.time,
                               gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task,
                               resources=resources, mem=args.mem)
    except SlurmError as err:
        print(f"trainkit: {err}; nothing written", file=sys.stderr)
        return EXIT_INVALID
    for note in (*resources.notes, resources.how):
        print(f"trainkit: note: {note}", file=sys.stderr)
    _write_or_print(script, args.output)
    return EXIT_OK


def cmd_bench_scaling(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .launch.scaling import ScalingError, bench_scaling, parse_reference
    from .recipe import RecipeError

    if bool(args.recipe) == bool(args.script):
        print("trainkit: bench scaling: give a RECIPE or --script PATH (one of them)", file=sys.stderr)
        return EXIT_INVALID
    try:
        nprocs = [int(n) for n in args.nproc.split(",")]
        reference = parse_reference(args.reference)
    except ValueError as exc:
        print(f"trainkit: bench scaling: --nproc is N,N,... and --reference N:SPEEDUP,... ({exc})", file=sys.stderr)
        return EXIT_INVALID
    try:
        folder, points = bench_scaling(
            recipe=Path(args.recipe) if args.recipe else None, script=Path(args.script) if args.script else None,
            nprocs=nprocs, steps=args.steps, warmup=args.warmup, batch=args.batch,
            out=Path(args.out) if args.out else None, overrides=list(args.overrides), reference=reference,
            reference_label=args.reference_label, mlflow_log=not args.no_mlflow)
    except RecipeError as exc:
        print(exc, file=sys.stderr)
        return EXIT_INVALID
    except ScalingError as exc:
        print(f"trainkit: bench scaling: {exc}", file=sys.stderr)
        return 1
    print((folder / "scaling.md").read_text(), end="")
    print(f"trainkit: bench scaling: {folder / 'scaling.md'}, {folder / 'scaling.png'}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from .runtime.export import ExportError, export

    try:
        if args.hf:
            from .runtime.export_hf import export_hf

            print(export_hf(args.checkpoint, args.out))
        else:
            print(export(args.checkpoint, args.out))
    except ExportError as exc:
        print(f"trainkit: export: {exc}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK


def cmd_make_imagefolder(args: argparse.Namespace) -> int:
    from .runtime.imagefolder_maker import make_imagefolder

    root = make_imagefolder(args.root, classes=args.classes, per_class=args.per_class, size=args.size, seed=args.seed,
                            val_per_class=args.val_per_class)
    if args.val_per_class > 0:
        print(f"wrote {args.classes} classes x {args.per_class} training images to {root / 'train'} and "
              f"x {args.val_per_class} held-out images to {root / 'val'}, {args.size}px")
    else:
        print(f"wrote {args.classes} classes x {args.per_class} images of {args.size}px to {root}")
    return EXIT_OK


def cmd_make_corpus(args: argparse.Namespace) -> int:
    from .runtime.text_data import write_corpus

    train, held_out = write_corpus(Path(args.folder), documents=args.documents, seed=args.seed)
    print(f"wrote {train} ({args.documents} documents) and {held_out}")
    return EXIT_OK


def cmd_make_chat_demo(args: argparse.Namespace) -> int:
    from .runtime.chat_demo import make_chat_demo

    made = make_chat_demo(Path(args.folder), seed=args.seed)
    print(f"wrote {made['model']} (a small random-weight Llama standing in for a pretrained model, with its "
          f"chat tokenizer), {made['train']} and {made['eval']}")
    return EXIT_OK


def cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from .runtime.text_data import train_tokenizer, tokenizer_vocab_size

    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        print(f"trainkit: error: not a file: {', '.join(missing)}", file=sys.stderr)
        return EXIT_INVALID
    if args.vocab_size < 257:
        print("trainkit: error: --vocab-size must be at least 257 (256 bytes and the end-of-text token)",
              file=sys.stderr)
        return EXIT_INVALID
    try:
        out = train_tokenizer(args.files, Path(args.out), vocab_size=args.vocab_size, text_field=args.text_field,
                              min_frequency=args.min_frequency)
    except ValueError as exc:
        print(f"trainkit: error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    print(f"wrote {out} ({tokenizer_vocab_size(str(out))} tokens)")
    return EXIT_OK


def cmd_runs(args: argparse.Namespace) -> int:
    from .tracking.browse import TrackingError, list_runs

    try:
        print(list_runs(args.uri, args.experiment, args.limit, include_superseded=args.all))
    except TrackingError as exc:
        print(f"trainkit: {exc.args[0]}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    from .tracking.browse import compare

    try:
        print(compare(args.runs, args.uri))
    except LookupError as exc:
        print(f"trainkit: {exc.args[0]}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK


def cmd_ui(args: argparse.Namespace) -> int:
    from .tracking.browse import ui

    return ui(args.uri, args.host, args.port)


def cmd_sync(args: argparse.Namespace) -> int:
    """Deliver what each spool holds; a run whose launch died without closing it (no live holder of
    RUN_DIR/launch.lock) is closed too: FINISHED if summary.json proves it completed, else KILLED.
    A spool torn by a crash is repaired from the run directory and what it lost reported (tracking/recovery.py).
    Exit 2 if a folder has no spool (nothing delivered), 1 if records are still pending anywhere, 3 if
    everything left was delivered but a torn spool lost records."""
    from pathlib import Path

    from .tracking.spool import Spool

    missing = [d for d in args.run_dirs if not Path(d).is_dir() or not Spool(Path(d)).path.is_file()]
    if missing:
        for d in missing:
            print(f"trainkit: {d} has no tracking spool (tracking/spool.jsonl)", file=sys.stderr)
        return EXIT_INVALID
    codes = [_sync_one(Path(d)) for d in args.run_dirs]
    return next((code for code in (EXIT_FAILED, EXIT_LOST) if code in codes), EXIT_OK)


def _sync_one(run_dir) -> int:
    from .launch.lock import describe, holder_alive
    from .tracking import recovery
    from .tracking.delivery import deliver
    from .tracking.run import open_status
    from .tracking.spool import Spool

    spool = Spool(run_dir)
    holder = holder_alive(run_dir)
    if holder:
        if open_status(run_dir) == "RUNNING":
            print(f"trainkit: {run_dir}: the run is still open: a launch is running ({describe(holder)})")
    else:  # nobody appends: a record cut mid-line is a tear, not an append in flight
        recovery.repair(run_dir)
        if open_status(run_dir) == "RUNNING":
            from .launch.launcher import close_run_left_open, completed, latest_launch

            if spool.state().get("tears"):
                launch_dir = latest_launch(run_dir)
                recovery.close_left_open(run_dir, launch_dir, completed(run_dir, launch_dir))
            else:
                closed = close_run_left_open(run_dir, announce=False)
                if closed:
                    recovery.expect_status(run_dir, closed, "the launch that wrote it died without closing its run")
    pending, error = deliver(run_dir)
    state = spool.state()
    losses, lost = recovery.report(run_dir)
    for line in losses:
        print(f"trainkit: {run_dir}: {line}", file=sys.stderr)
    if pending:
        from .tracking.credentials import withheld_note
        from .tracking.run import store_of

        store = store_of(run_dir)
        note = withheld_note(store) if store else ""
        print(f"trainkit: {run_dir}: {pending} record(s) still pending: {error}{note}", file=sys.stderr)
        return EXIT_FAILED
    closing = recovery.closed(run_dir)  # a status this sync spooled is announced once the server holds it
    if closing:
        status, why, seen = closing
        if seen != status:
            print(f"trainkit: {run_dir}: {why}: {status} was delivered, but the server shows the run "
                  f"{seen or 'unreachable'}", file=sys.stderr)
            return EXIT_FAILED
        print(f"trainkit: {run_dir}: {why}: marked {status}")
    if lost:
        print(f"trainkit: {run_dir}: what is left was delivered to run {state.get('run_id')} in {state.get('uri')}, "
              f"but records were lost (above)", file=sys.stderr)
        return EXIT_LOST
    print(f"trainkit: {run_dir}: all tracking records delivered to run {state.get('run_id')} in {state.get('uri')}")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .analysis import evidence
    from .analysis.bottleneck import diagnose_evidence
    from .recipe import RecipeError, resolve
    from .run_dir import BREAKDOWN, RECIPE, RESOLVED_RECIPE, report_path

    run_dir = Path(args.run_dir)
    evidence_path = report_path(run_dir, BREAKDOWN)
    from .launch.oom import report_lines

    out_of_memory = report_lines(run_dir)  # a run that ran out of memory: why, and its GPU memory history
    if out_of_memory:
        print("\n".join(out_of_memory))
        if not evidence_path.is_file():
            return EXIT_FAILED
    if not evidence_path.is_file():
        print(f"trainkit: {evidence_path} not found: is {run_dir} a finished trainkit run directory?", file=sys.stderr)
        return EXIT_INVALID
    try:
        found = evidence.read(run_dir)
    except ValueError:
        print(f"trainkit: {evidence_path} is not valid JSON (cut short by a crash?)", file=sys.stderr)
        return EXIT_FAILED
    try:
        recipe = resolve(run_dir / RECIPE).recipe
    except RecipeError:  # its ${oc.env:...} references need the run's environment: the shown copy will do
        recipe = resolve(run_dir / RESOLVED_RECIPE).recipe
    print(diagnose_evidence(found, recipe).markdown(recipe.name), end="")
    return EXIT_OK


def cmd_top(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .analysis.top import NotARunDir, top

    try:
        return top(Path(args.run_dir), interval=args.interval, once=args.once)
    except NotARunDir as err:
        print(f"trainkit: {err}", file=sys.stderr)
        return EXIT_INVALID


def cmd_plugins(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from .scaffold import ScaffoldError, kind_of, listing, scaffold

    action = list(args.action)
    try:
        if action[:1] == ["new"]:
            if len(action) != 3:
                print("usage: trainkit plugins new KIND NAME (KIND: model, dataset, strategy, monitor)",
                      file=sys.stderr)
                return EXIT_INVALID
            root = scaffold(action[1], action[2], Path(args.dir))
            python = sys.executable  # the environment that runs trainkit, activated or not
            # pip reads a bare `trainkit-NAME` as a name to fetch from the package index: show a path
            local = str(root) if os.sep in str(root) else f".{os.sep}{root}"
            print(f"trainkit: wrote {root}\n  install: {python} -m pip install {local}\n"
                  f"  test:    {python} -m pytest {root / 'tests'}")
            return EXIT_OK
        if len(action) > 1:
            print("usage: trainkit plugins [KIND] | trainkit plugins new KIND NAME", file=sys.stderr)
            return EXIT_INVALID
        text, warnings = listing([kind_of(action[0])] if action else None)
    except ScaffoldError as err:
        print(f"trainkit: {err}", file=sys.stderr)
        return EXIT_INVALID
    print(text)
    for w in warnings:
        print(f"trainkit: warning: {w}", file=sys.stderr)
    return EXIT_OK


def cmd_init(args: argparse.Namespace) -> int:
    from .recipe.init import InitError, write_recipe

    try:
        out, summary = write_recipe(args, ask=None if args.yes else _ask)
    except InitError as exc:
        print(f"trainkit: init: {exc}", file=sys.stderr)
        return EXIT_INVALID
    print(summary)
    print(f"next: trainkit plan {out}   (then: trainkit run {out})")
    return EXIT_OK


def _ask(question: str, default: str) -> str:
    """One question on stderr, the answer from stdin; Enter (or end of input) takes the default."""
    print(f"{question} [{default}]: ", end="", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    if not line:
        print(file=sys.stderr)
    return line.strip() or default


def cmd_completion(args: argparse.Namespace) -> int:
    from .recipe.completion import script

    print(script(args.shell), end="")
    return EXIT_OK


# ----------------------------------------------------------------------------- entry point
def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["__complete"]:  # called by the shell completion scripts (`trainkit completion`)
        from .recipe.completion import complete_from_env

        return _quiet_on_broken_pipe(lambda: complete_from_env(build_parser()))
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    recipe_args = [*getattr(args, "paths", []), *getattr(args, "overrides", [])]
    if hasattr(args, "paths") or hasattr(args, "overrides"):  # one grammar for every command that takes a recipe
        from .recipe.arguments import grammar_error

        mistake = grammar_error(recipe_args, unknown)
        if mistake:
            print(f"trainkit {args.command}: {mistake}", file=sys.stderr)
            return EXIT_INVALID
    if unknown:
        parser.parse_args(argv)  # argparse's own message for anything else
    if args.version:
        from . import __version__

        print(f"trainkit {__version__}")
        return EXIT_OK
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_INVALID
    return _run_reporting_errors(args.func, args)


def _run_reporting_errors(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """User mistakes become messages and exit codes, never tracebacks."""
    from .recipe.problems import RecipeError
    from .registry import PluginError

    try:
        code = func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return code
    except RecipeError as err:
        print(err, file=sys.stderr)
        print(f"{len(err.problems)} problem(s); nothing was started.", file=sys.stderr)
        return EXIT_INVALID
    except PluginError as err:
        print(f"trainkit: {err}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        print("trainkit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `trainkit schema | head`: the reader has gone; stop as Unix tools do
        return _stdout_gone()
    except OSError as err:  # an unwritable folder, a full disk, a missing file: say which, no traceback
        where = f": {err.filename}" if err.filename else ""
        print(f"trainkit: {err.strerror or err}{where}", file=sys.stderr)
        return EXIT_FAILED


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what the shell reports for a Unix tool killed by a closed pipe


def _stdout_gone() -> int:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again, noisily."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


def _quiet_on_broken_pipe(func: Callable[[], int]) -> int:
    try:
        code = func()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _stdout_gone()


def entry() -> int:
    """The `trainkit` program (console script and `python -m trainkit.cli`): `main`, then its objects
    are left to the OS. The interpreter's shutdown would otherwise garbage-collect everything torch,
    dynamo (imported by the pre-launch memory trace) and torchrun's agent created: ~0.6 s of every
    `trainkit run` on 2 cores (median of 6 alternated pairs, 7.7 -> 7.05 s for a 3-step run).
    `gc.freeze` keeps what a normal exit does -- atexit handlers, joining non-daemon threads, flushing
    the streams -- and skips only the collection. Not in `main`, which tests also call in-process."""
    import gc

    code = main()
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(entry())
