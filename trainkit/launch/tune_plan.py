"""What `trainkit tune` tries: the recipe changes the baseline's bottleneck advice proposes
(`Advice.changes`), each through the knob that sets its key, or the knobs named with `--knobs`.

Nothing is dropped silently: advice whose key no knob sets, knobs that do not apply to this recipe or
machine, and knobs the advice does not point at are all listed (`Plan.skipped`, `Plan.unpointed`),
in the console and in the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..analysis.advice import change_text, show
from ..analysis.bottleneck import Diagnosis
from ..analysis.evidence import Evidence
from . import tune_knobs, tune_stats
from .tune_knobs import Knob


@dataclass
class Arm:
    """One change to try: a knob at a value (plus the keys it changes alongside), or the baseline."""

    name: str
    changes: dict[str, Any] = field(default_factory=dict)  # recipe key -> value
    knob: Optional[Knob] = None
    value: Any = None
    note: str = ""  # the semantic change, in words
    verdict: Optional[tune_stats.Verdict] = None
    failure: str = ""
    done: bool = False

    def overrides(self) -> list[str]:
        return [tune_knobs.override_text(k, v) for k, v in self.changes.items()]


@dataclass
class Plan:
    arms: list[Arm] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (knob or recipe key, why not tried)
    unpointed: list[str] = field(default_factory=list)  # knobs the advice does not point at


def machine_facts(evidence: Optional[Evidence]) -> dict:
    """What a knob may assume about the machine the trials run on: from the baseline's evidence (where
    it ran), else from this process."""
    device = (evidence.env if evidence is not None else {}).get("device")
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return {"cuda": device == "cuda"}


def _why_not(knob: Knob, recipe, allow: frozenset[str], facts: dict) -> Optional[str]:
    why = tune_knobs.not_applicable(knob, recipe, facts)
    if why is None and knob.semantic and knob.semantic not in allow:
        why = f"changes the training ({knob.semantic}): tried only with --allow {knob.semantic}"
    return why


def _arm(knob: Knob, recipe, value: Any, changes: Optional[dict] = None) -> Arm:
    changes = changes or {knob.path: value, **knob.also(recipe, value)}
    return Arm(f"{knob.name}={show(value)}", dict(changes), knob, value, knob.note(recipe, value))


def named(recipe, names: list[str], allow: frozenset[str], facts: dict) -> Plan:
    """`--knobs`: each named knob at the values it tries, whatever the diagnosis says."""
    known, plan = tune_knobs.all_knobs(), Plan()
    for name in names:
        knob = known[name]
        why = _why_not(knob, recipe, allow, facts)
        values = knob.values(recipe, facts) if why is None else []
        if why is None and not values and knob in tune_knobs.MESH_KNOBS:
            why = "tried only at the value the bottleneck advice proposes (a mesh the compatibility matrix verifies)"
        if why is None and not values:
            why = f"nothing to try: {knob.path} is already {tune_knobs.get(recipe, knob.path)}"
        if why:
            plan.skipped.append((name, why))
            continue
        plan.arms += [_arm(knob, recipe, value) for value in values]
    return plan


def advised(recipe, diagnosis: Optional[Diagnosis], allow: frozenset[str], facts: dict) -> Plan:
    """The changes the baseline's advice proposes, each at the advised value with what the advice
    changes alongside it (e.g. the learning rate with a larger batch)."""
    plan = Plan()
    if diagnosis is None:
        plan.skipped.append(("all knobs", "the baseline trial left no bottleneck evidence to choose from "
                                          "(reports/breakdown.json); name knobs with --knobs"))
        return plan
    known = tune_knobs.all_knobs()
    by_path = {k.path: k for k in known.values()}
    proposed = diagnosis.changes()
    for advice in diagnosis.ranked():
        if advice.key is None:
            plan.skipped.append((advice.action, "proposes no recipe change"))
    for key, advice in proposed.items():
        value = advice.changes[key]
        knob = by_path.get(key)
        if knob is None:
            plan.skipped.append((key, f"advised ({change_text(key, advice.was.get(key), value)}), but no tune knob "
                                      f"sets {key}: change it by hand if the report's reason fits"))
            continue
        why = _why_not(knob, recipe, allow, facts)
        if why:
            plan.skipped.append((knob.name, why))
            continue
        plan.arms.append(_arm(knob, recipe, value, advice.changes))
    plan.unpointed = [name for name, knob in known.items() if knob.path not in proposed
                      and knob not in tune_knobs.MESH_KNOBS and tune_knobs.not_applicable(knob, recipe, facts) is None]
    return plan
