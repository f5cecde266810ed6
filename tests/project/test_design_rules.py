"""Every rule has one home in the core, and every shell runs that one function.

The rule table in docs/design.md names one function per rule; these tests
keep the table true and show that swapping a rule's function changes the
behaviour of the Trio orchestrator and of every asyncio reference alike.
"""

from __future__ import annotations

import inspect
import pathlib
import re
import types
from typing import Any

import pytest

from bench.implementations import make_driver, names
from trio_orch import core
from trio_orch.core import (
    Router,
    Submit,
    admission,
    companions,
    control,
    events,
    failover,
    membership,
    routing,
    streaming,
)
from trio_orch.core.state import CoreState

DOC = pathlib.Path(__file__).parents[2] / "docs" / "design.md"
#: where a rule may live: a module of rule functions, or the state's own primitives
HOMES: dict[str, type | types.ModuleType] = {
    "admission": admission, "companions": companions, "control": control, "events": events,
    "failover": failover, "membership": membership, "routing": routing, "streaming": streaming,
    "CoreState": CoreState}


def rule_table() -> list[tuple[str, str, str]]:
    text = DOC.read_text()
    block = text.split("<!-- rules:begin -->")[1].split("<!-- rules:end -->")[0]
    return [(m[1].strip(), m[2], m[3]) for m in re.finditer(r"^\| (.+?) \| `(\w+)\.(\w+)` \|$", block, re.M)]


def test_every_rule_in_the_design_table_names_one_existing_core_function() -> None:
    rows = rule_table()
    assert len(rows) >= 15
    for rule, home, fn in rows:
        assert home in HOMES, f"{rule}: {home} is not a rule module of the core (nor CoreState)"
        where = HOMES[home]
        if isinstance(where, type):
            assert fn in vars(where), f"{rule}: {home}.{fn} does not exist (or is inherited)"
        else:
            f = getattr(where, fn, None)
            assert inspect.isfunction(f) and f.__module__ == where.__name__, (
                f"{rule}: {home}.{fn} is not a function defined in {where.__name__}")
    assert len({(h, f) for _, h, f in rows}) == len(rows), "a function is named for two rules"


def test_the_core_is_one_state_with_its_rules_beside_it() -> None:
    """No inheritance chain: the Router is the state and names functions of the rule modules (none of
    its methods is written in the facade, apart from its statistics and container protocol)."""
    assert len(Router.__mro__) <= 5 and Router.__mro__[1] is CoreState
    assert core.Router is Router
    homes = {m.__name__ for m in HOMES.values() if not isinstance(m, type)}
    bound = {name: v.__func__ if isinstance(v, staticmethod) else v.fget if isinstance(v, property) else v
             for name, v in vars(Router).items()}
    own = {name for name, v in bound.items() if inspect.isfunction(v) and v.__module__ not in homes}
    assert own == {"__len__", "__contains__", "statistics"}, own
    rules = {getattr(m, f) for _, h, f in rule_table() if not isinstance(m := HOMES[h], type)}
    assert events.route_many in rules and Router.route_many is events.route_many


def swap(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType, name: str, new: Any) -> None:
    """Replace a rule function everywhere it is bound: its module (other rules call it from there) and
    the Router (the shells call it from there)."""
    old = getattr(module, name)
    monkeypatch.setattr(module, name, new)
    for attr, value in vars(Router).items():
        if value is old:
            monkeypatch.setattr(Router, attr, new)


@pytest.mark.parametrize("impl", names("scripted"))
def test_swapping_a_rule_function_changes_every_shell(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    accept, forward = admission.accept, routing.forward

    def strict_accept(state: Any, request_id: str, prompt: Any, **kw: Any) -> Any:
        if request_id.startswith("x"):
            raise ValueError("refused by the swapped admission rule")
        return accept(state, request_id, prompt, **kw)

    def tagged_forward(state: Any, req: Any, stage_id: int) -> list[Any]:
        return [Submit(a.stage_id, a.request_id, ("swapped", a.payload)) if type(a) is Submit else a
                for a in forward(state, req, stage_id)]

    swap(monkeypatch, admission, "accept", strict_accept)
    swap(monkeypatch, routing, "forward", tagged_forward)
    with make_driver(impl, 2, {1}).start() as h:
        with pytest.raises(ValueError, match="swapped admission rule"):
            h.add_request("x1", "p")
        h.add_request("r1", "p")
        h.emit(0, "r1", "a", finished=True)
        assert h.wait_until(lambda: h.submissions(1) == [("r1", ("swapped", ["a"]))])
        h.emit(1, "r1", "done", finished=True)
        assert h.next_output().finished
        assert h.submissions(0) == [("r1", "p")]  # x1 never reached a stage
