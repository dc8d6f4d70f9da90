"""The decision rule of `trainkit tune`: is a change proven faster than the baseline?

Trials alternate with baseline trials (B C B C B ...), so each candidate trial is paired with the mean
of the two baseline trials around it: slow drift of the machine (another job, thermal state) hits both
sides of a pair and cancels out. A change is kept only when

1. at least MIN_PAIRS pairs were measured and the bootstrap 95% interval of the mean log throughput
   ratio (candidate / its baselines) lies above 1, and
2. the median gain is at least MIN_GAIN and at least NOISE_FACTOR x the noise: the larger of the
   baseline-vs-baseline noise (the median |ratio - 1| of consecutive baseline trials: a gain the
   baseline shows against itself is not a gain) and the spread of the candidate's own ratios (their
   median absolute deviation: a few lucky pairs among scattered ones are not a gain either).

Why 5 pairs: with 3, three ratios above 1 happen by chance one time in eight, and a 3-point
bootstrap interval is as narrow as those three points; a full-suite run once "proved" a flag that
does nothing on this machine that way. With 5 the chance is one in 32 before the noise condition.

It is rejected as slower when the interval lies below 1, and as "no significant gain" when the trial
budget for that knob is spent first. Pure Python: no torch, no numpy.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

MIN_PAIRS = 5  # fewer paired ratios cannot give a meaningful interval (see above)
MAX_PAIRS = 7  # trials per change before it is called "no significant gain"
MIN_GAIN = 0.03  # a smaller gain is not worth a recipe change even if it were real
NOISE_FACTOR = 3.0
BOOTSTRAP_RESAMPLES = 4000

KEEP, SLOWER, NOT_SIGNIFICANT, UNDECIDED = "keep", "slower", "no significant gain", "undecided"


@dataclass
class Verdict:
    decision: str  # KEEP | SLOWER | NOT_SIGNIFICANT | UNDECIDED
    gain: Optional[float]  # median ratio - 1
    low: Optional[float]  # 95% interval of the ratio
    high: Optional[float]
    pairs: int

    def interval(self) -> str:
        if self.low is None:
            return "-"
        return f"{self.low:.3f}-{self.high:.3f}"


def bootstrap_interval(ratios: Sequence[float], seed: int = 0,
                       resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the geometric mean of `ratios` (seeded: reproducible)."""
    logs = [math.log(r) for r in ratios]
    rng = random.Random(seed)
    n = len(logs)
    means = sorted(sum(rng.choice(logs) for _ in range(n)) / n for _ in range(resamples))
    return math.exp(means[int(0.025 * resamples)]), math.exp(means[int(0.975 * resamples) - 1])


def noise(baselines: Sequence[float]) -> Optional[float]:
    """Median |ratio - 1| of consecutive baseline trials' throughputs (None with fewer than 2)."""
    pairs = [b / a for a, b in zip(baselines, baselines[1:]) if a > 0]
    return statistics.median(abs(r - 1) for r in pairs) if pairs else None


def judge(ratios: Sequence[float], baseline_noise: Optional[float], final: bool) -> Verdict:
    """The verdict on one change from its paired ratios; `final`: no more trials will come."""
    if len(ratios) < MIN_PAIRS:
        return Verdict(NOT_SIGNIFICANT if final else UNDECIDED,
                       statistics.median(ratios) - 1 if ratios else None, None, None, len(ratios))
    low, high = bootstrap_interval(ratios)
    middle = statistics.median(ratios)
    gain = middle - 1
    spread = statistics.median(abs(r - middle) for r in ratios)
    needed = max(MIN_GAIN, NOISE_FACTOR * max(baseline_noise or 0.0, spread))
    if low > 1.0 and gain >= needed:
        return Verdict(KEEP, gain, low, high, len(ratios))
    if high < 1.0:
        return Verdict(SLOWER, gain, low, high, len(ratios))
    return Verdict(NOT_SIGNIFICANT if final else UNDECIDED, gain, low, high, len(ratios))


def paired_ratios(sequence: Sequence[tuple[str, float]], arm: str) -> list[float]:
    """Each trial of `arm` against the mean of the baseline trials just before and after it (the
    nearest one if it is at an end). `sequence`: (arm, samples/s) in the order the trials ran."""
    ratios = []
    for i, (name, value) in enumerate(sequence):
        if name != arm:
            continue
        before = next((v for n, v in reversed(sequence[:i]) if n == "baseline"), None)
        after = next((v for n, v in sequence[i + 1:] if n == "baseline"), None)
        around = [v for v in (before, after) if v]
        if around:
            ratios.append(value / (sum(around) / len(around)))
    return ratios


class Measurements:
    """Every measured trial's throughput in the order the trials ran, and the verdicts drawn from them."""

    def __init__(self) -> None:
        self.sequence: list[tuple[str, float]] = []  # (arm, samples/s)

    def add(self, arm: str, samples_per_s: float) -> None:
        self.sequence.append((arm, samples_per_s))

    def values(self, arm: str) -> list[float]:
        return [v for n, v in self.sequence if n == arm]

    def median(self, arm: str) -> Optional[float]:
        values = self.values(arm)
        return statistics.median(values) if values else None

    def noise(self) -> Optional[float]:
        return noise(self.values("baseline"))

    def ratios(self, arm: str) -> list[float]:
        return paired_ratios(self.sequence, arm)

    def verdict(self, arm: str, final: bool) -> Verdict:
        return judge(self.ratios(arm), self.noise(), final)
