"""The MLflow key of each trainkit metric, chosen so the UI shows the learning curves first.

MLflow's UI groups a run's charts into sections by the key's part before its last "/", orders
those sections alphabetically, then shows the keys without a "/" ("Model metrics") and last the
`system/` ones ("System metrics"); within a section, charts follow the key's order. Logged with
their own names, the loss curve came after the `breakdown/`, `throughput/` and `time/` sections.

So every metric goes under `train/`: the curves a user looks at first (loss, eval metrics,
learning rate) in the `train` section itself, which sorts before every `train/...` section; the
step-level and monitor metrics in those (`train/step`, `train/breakdown`, `train/throughput`, ...).
`system/` keys stay as they are (MLflow's System metrics tab). metrics.jsonl keeps the plain names:
this is only how MLflow sees them.
"""

from __future__ import annotations

ROOT = "train"
STEP = f"{ROOT}/step"
CURVES = ("loss", "loss_max", "lr")  # besides every eval_* metric
SYSTEM = "system/"


def mlflow_key(name: str) -> str:
    """`loss` -> `train/loss`, `eval_accuracy` -> `train/eval_accuracy`, `grad_norm` -> `train/step/grad_norm`,
    `breakdown/forward_s` -> `train/breakdown/forward_s`; `system/...` unchanged."""
    if name.startswith(SYSTEM):
        return name
    if "/" in name or name in CURVES or name.startswith("eval_"):
        return f"{ROOT}/{name}"
    return f"{STEP}/{name}"
