"""The `trainkit` command line.

Light at import time on purpose: `trainkit --help` and `trainkit validate` never import torch,
DeepSpeed or MLflow; each sub-command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


def _positive(text: str) -> int:
    value = int(text) if text.lstrip("-").isdigit() else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="override recipe values, e.g. trainer.max_steps=20 strategy.name=fsdp")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainkit",
        description="One YAML recipe -> a correct, fast, observable distributed PyTorch training run.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("validate", help="check recipes (fast: no torch import; --deep for runtime checks)")
    p.add_argument("paths", nargs="+", metavar="PATH", help="recipe files, folders or globs")
    p.add_argument("--format", choices=["text", "json", "github"], default="text",
                   help="text for people, json for tools, github for Actions annotations")
    p.add_argument("--deep", action="store_true",
                   help="also run checks that import torch and the model's module (never other recipe code): model "
                        "exists and is a model factory, data paths, devices, DeepSpeed config")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("schema", help="print the recipe JSON Schema (for editor autocompletion)")
    p.add_argument("--markdown", action="store_true", help="print the recipe reference (docs/reference.md) instead")
    p.add_argument("--all", action="store_true", help="with --markdown: include installed third-party plugins")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("plan", help="print the resolved recipe, what it implies, and the torchrun command")
    p.add_argument("recipe", metavar="RECIPE")
    _add_overrides(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("run", help="validate, then train under torchrun")
    p.add_argument("recipe", metavar="RECIPE")
    p.add_argument("--accept-changes", action="store_true",
                   help="resume even though the recipe changed in keys that alter training (they take effect; "
                        "MLflow continues in a new linked run)")
    _add_overrides(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("doctor", help="can this machine run it? versions, GPUs, ports, /dev/shm, limits, disk, data "
                       "(exit 1 if any check fails)")
    p.add_argument("recipe", nargs="?", metavar="RECIPE", help="without it: machine-level checks only")
    _add_overrides(p)
    p.add_argument("--format", choices=["text", "json"], default="text", help="text for people, json for CI")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("export", help="write a checkpoint's model as one consolidated state_dict file (any strategy)")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="e.g. runs/NAME/checkpoints/step-00000100")
    p.add_argument("out", metavar="OUT.pt", help="file for torch.load + model.load_state_dict")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("runs", help="list recent runs in the MLflow store")
    p.add_argument("--uri", help="tracking URI (default: MLFLOW_TRACKING_URI, else ./mlflow.db)")
    p.add_argument("--experiment", help="only this experiment")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--all", action="store_true", help="also list attempts superseded by a later run of the job")
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("compare", help="side-by-side table of runs: differing params, final/best metrics")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run ids (or unique prefixes) or run names")
    p.add_argument("--uri", help="tracking URI (default: MLFLOW_TRACKING_URI, else ./mlflow.db)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("ui", help="start the MLflow UI on the tracking store (loopback by default)")
    p.add_argument("--uri", help="tracking URI (default: MLFLOW_TRACKING_URI, else ./mlflow.db)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; the MLflow UI has no authentication)")
    p.add_argument("--port", type=int, default=5000)
    p.set_defaults(func=cmd_ui)

    p = sub.add_parser("sync", help="deliver a run's spooled tracking records (after a server outage)")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.set_defaults(func=cmd_sync)

    p = sub.add_parser("report", help="the bottleneck report of a past run (from RUN_DIR/reports/breakdown.json)")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("data", help="data helpers")
    data_sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    m = data_sub.add_parser("make-imagefolder", help="write a small synthetic ImageFolder of real image files")
    m.add_argument("root", metavar="DIR")
    m.add_argument("--classes", type=_positive, default=10)
    m.add_argument("--per-class", type=_positive, default=50)
    m.add_argument("--size", type=_positive, default=64)
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_make_imagefolder)
    m = data_sub.add_parser("make-corpus", help="write a synthetic-language text corpus (train.txt, eval.txt)")
    m.add_argument("folder", metavar="DIR")
    m.add_argument("--documents", type=_positive, default=2000, help="training documents (eval: a tenth)")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_make_corpus)
    m = data_sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer (tokenizers) on text/JSONL files")
    m.add_argument("files", metavar="FILE", nargs="+")
    m.add_argument("--out", required=True, metavar="TOKENIZER_JSON")
    m.add_argument("--vocab-size", type=_positive, default=8192)
    m.add_argument("--text-field", default="text", help="the JSONL field holding the text")
    m.add_argument("--min-frequency", type=_positive, default=2)
    m.set_defaults(func=cmd_train_tokenizer)
    return parser


# ----------------------------------------------------------------------------- commands
def cmd_validate(args: argparse.Namespace) -> int:
    from .recipe import RecipeError, resolve
    from .recipe.discovery import expand_recipe_paths
    from .recipe.problems import Location, Problem, format_problems

    files, missing = expand_recipe_paths(args.paths)
    problems: list[Problem] = [Problem(Location(m), "", "no such file, folder or matching recipe") for m in missing]
    invalid = len(missing)
    for file in files:
        try:
            resolved = resolve(file)
            found = _deep_problems(resolved) if args.deep else []
        except RecipeError as err:
            found = err.problems
        if any(p.severity == "error" for p in found):
            invalid += 1
        problems.extend(found)
    if args.format == "text":
        if problems:
            print(format_problems(problems), file=sys.stderr)
        total = len(files) + len(missing)
        print(f"{total - invalid} of {total} recipe(s) valid"
              + ("" if args.deep else " (not checked without --deep, which imports the model's module: model "
                 "exists and is a model factory, data paths, devices, DeepSpeed config)"))
    else:
        print(format_problems(problems, args.format))
    return EXIT_INVALID if invalid else EXIT_OK


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
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise RecipeError(errors)
    print(describe(resolved, args.recipe, args.overrides))
    for p in problems:
        print(p, file=sys.stderr)
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from .recipe import resolve

    resolved = resolve(args.recipe, args.overrides)
    from .launch import launcher

    return launcher.run(resolved, args.recipe, list(args.overrides), accept_changes=args.accept_changes)


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


def cmd_export(args: argparse.Namespace) -> int:
    from .runtime.export import ExportError, export

    try:
        print(export(args.checkpoint, args.out))
    except ExportError as exc:
        print(f"trainkit: export: {exc}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK


def cmd_make_imagefolder(args: argparse.Namespace) -> int:
    from .runtime.imagefolder_maker import make_imagefolder

    root = make_imagefolder(args.root, classes=args.classes, per_class=args.per_class, size=args.size, seed=args.seed)
    print(f"wrote {args.classes} classes x {args.per_class} images of {args.size}px to {root}")
    return EXIT_OK


def cmd_make_corpus(args: argparse.Namespace) -> int:
    from .runtime.text_data import write_corpus

    train, held_out = write_corpus(Path(args.folder), documents=args.documents, seed=args.seed)
    print(f"wrote {train} ({args.documents} documents) and {held_out}")
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
    """Deliver what the spool holds; a run whose launch died without closing it (no live holder of
    RUN_DIR/launch.lock) is closed too: FINISHED if summary.json proves it completed, else KILLED."""
    from pathlib import Path

    from .launch.lock import describe, holder_alive
    from .tracking.delivery import deliver
    from .tracking.run import open_status
    from .tracking.spool import Spool

    run_dir = Path(args.run_dir)
    spool = Spool(run_dir)
    if not run_dir.is_dir() or not spool.path.is_file():
        print(f"trainkit: {args.run_dir} has no tracking spool (tracking/spool.jsonl)", file=sys.stderr)
        return EXIT_INVALID
    closed = None
    if open_status(run_dir) == "RUNNING":
        holder = holder_alive(run_dir)
        if holder:
            print(f"trainkit: the run is still open: a launch is running ({describe(holder)})")
        else:
            from .launch.launcher import finalize_dead_launch

            closed = finalize_dead_launch(run_dir, announce=False)
    pending, error = deliver(run_dir)
    state = spool.state()
    if pending:
        print(f"trainkit: {pending} record(s) still pending: {error}", file=sys.stderr)
        return EXIT_FAILED
    if closed:
        print(f"trainkit: the launch that wrote {run_dir} died without closing its run: marked {closed}")
    print(f"trainkit: all tracking records delivered to run {state.get('run_id')} in {state.get('uri')}")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .monitors.bottleneck import diagnose
    from .recipe import RecipeError, resolve

    run_dir = Path(args.run_dir)
    evidence_path = run_dir / "reports" / "breakdown.json"
    if not evidence_path.is_file():
        print(f"trainkit: {evidence_path} not found: is {run_dir} a finished trainkit run directory?", file=sys.stderr)
        return EXIT_INVALID
    try:
        evidence = json.loads(evidence_path.read_text())
    except ValueError:
        print(f"trainkit: {evidence_path} is not valid JSON (cut short by a crash?)", file=sys.stderr)
        return EXIT_FAILED
    try:
        recipe = resolve(run_dir / "recipe.yaml").recipe
    except RecipeError:  # its ${oc.env:...} references need the run's environment: the shown copy will do
        recipe = resolve(run_dir / "recipe.resolved.yaml").recipe
    print(diagnose(evidence["per_rank"], recipe).markdown(recipe.name), end="")
    return EXIT_OK


# ----------------------------------------------------------------------------- entry point
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
        return func(args)
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
    except OSError as err:  # an unwritable folder, a full disk, a missing file: say which, no traceback
        where = f": {err.filename}" if err.filename else ""
        print(f"trainkit: {err.strerror or err}{where}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
