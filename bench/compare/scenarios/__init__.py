"""The comparison's scenario matrix: twelve experiments, numbered as in issue 5.

``SCENARIOS`` lists them in order; each is a :class:`~bench.compare.scenarios.base.Scenario`
whose ``measure(impl)`` runs it against one implementation and whose
``judge(metrics)`` derives the verdict from the measured numbers.
"""

from __future__ import annotations

from bench.compare.scenarios.base import Outcome, Scenario, run_scenario
from bench.compare.scenarios.client import S7, S9, S10, S11
from bench.compare.scenarios.running import S3, S6, S12
from bench.compare.scenarios.shutdown import S1, S2, S4, S5, S8

__all__ = ["SCENARIOS", "Outcome", "Scenario", "by_number", "run_scenario"]

SCENARIOS: list[Scenario] = [S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11, S12]


def by_number(n: int) -> Scenario:
    for sc in SCENARIOS:
        if sc.number == n:
            return sc
    raise ValueError(f"no scenario {n}: choose from {', '.join(str(s.number) for s in SCENARIOS)}")
