"""The comparison's scenario matrix: numbered experiments, each a :class:`~.base.Scenario`.

Every ``Scenario`` defined at module level in a module of this package is in
the matrix, ordered by its number (numbers are unique): adding one to any
module here is all it takes.  ``measure(impl)`` runs it against one
implementation; ``judge(metrics)`` derives the verdict from the measured
numbers.  The modules: :mod:`.shutdown` (stopping), :mod:`.running` (faults
while running), :mod:`.client` (the client side); :mod:`.base` holds what
they share.
"""

from __future__ import annotations

import importlib
import pkgutil

from bench.compare.scenarios.base import Outcome, Scenario, run_scenario

__all__ = ["SCENARIOS", "Outcome", "Scenario", "by_number", "run_scenario"]


def _collect() -> list[Scenario]:
    found: dict[int, Scenario] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, Scenario):
                if found.get(obj.number, obj) is not obj:
                    raise RuntimeError(f"two scenarios numbered {obj.number}: "
                                       f"{found[obj.number].key!r} and {obj.key!r}")
                found[obj.number] = obj
    return [found[n] for n in sorted(found)]


#: every scenario, in number order
SCENARIOS: list[Scenario] = _collect()


def by_number(n: int) -> Scenario:
    for sc in SCENARIOS:
        if sc.number == n:
            return sc
    raise ValueError(f"no scenario {n}: choose from {', '.join(str(s.number) for s in SCENARIOS)}")
