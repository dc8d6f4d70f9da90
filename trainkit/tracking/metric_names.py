"""The MLflow key of each trainkit metric, chosen so the UI shows the learning curves first.

MLflow's UI groups a run's charts into sections by the key's part before its last "/", orders
those sections alphabetically, then shows the keys without a "/" ("Model metrics") and last the
`system/` ones ("System metrics"); within a section, charts follow the key's order. Logged with
their own names, the loss curve came after the `breakdown/`, `throughput/` and `time/` sections.

So every metric goes under `train/`: the training curves (loss, learning rate) in the `train`
section itself, which sorts before every `train/...` section; evaluation metrics in `train/eval`
(`eval_accuracy` -> `train/eval/accuracy`), which sorts next: an `eval/` section of its own would sort
before `train` and push the loss curve down. The step-level and monitor metrics follow in sections
that sort after `eval` (`train/gpu`, `train/memory`, `train/step`, `train/throughput`, ...); the
time breakdown, whose own name would sort before it, is a part of the step (`train/step/breakdown`).
`system/` keys stay as they are (MLflow's System metrics tab). metrics.jsonl keeps the plain names:
this is only how MLflow sees them.
"""

from __future__ import annotations

ROOT = "train"
STEP = f"{ROOT}/step"
CURVES = ("loss", "loss_max", "lr")
EVAL = "eval_"
EVAL_SECTION = f"{ROOT}/eval"
BREAKDOWN = "breakdown/"
SYSTEM = "system/"


def mlflow_key(name: str) -> str:
    """`loss` -> `train/loss`, `eval_accuracy` -> `train/eval/accuracy`, `grad_norm` -> `train/step/grad_norm`,
    `breakdown/forward_s` -> `train/step/breakdown/forward_s`, `throughput/mfu` -> `train/throughput/mfu`;
    `system/...` unchanged."""
    if name.startswith(SYSTEM):
        return name
    if name.startswith(EVAL):
        return f"{EVAL_SECTION}/{name[len(EVAL):]}"
    if name.startswith(BREAKDOWN):
        return f"{STEP}/{name}"
    if "/" in name or name in CURVES:
        return f"{ROOT}/{name}"
    return f"{STEP}/{name}"
