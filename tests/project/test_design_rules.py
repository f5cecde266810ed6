"""Every rule has one home in the core, and every shell runs that one function.

The rule table in docs/design.md names one function per rule; these tests
keep the table true and show that swapping a rule's function changes the
behaviour of the Trio orchestrator and of every asyncio reference alike.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest

from bench.implementations import make_driver, names
from trio_orch import core
from trio_orch.core import Submit
from trio_orch.core.admission import AdmissionRules
from trio_orch.core.companions import CompanionRules
from trio_orch.core.control import ControlRules
from trio_orch.core.failover import FailoverRules
from trio_orch.core.membership import MembershipRules
from trio_orch.core.routing import RoutingRules
from trio_orch.core.state import CoreState
from trio_orch.core.streaming import StreamingRules

DOC = pathlib.Path(__file__).parents[2] / "docs" / "design.md"
CLASSES = {"AdmissionRules": AdmissionRules, "RoutingRules": RoutingRules, "CoreState": CoreState,
           "StreamingRules": StreamingRules, "CompanionRules": CompanionRules, "ControlRules": ControlRules,
           "MembershipRules": MembershipRules, "FailoverRules": FailoverRules}


def rule_table() -> list[tuple[str, str, str]]:
    text = DOC.read_text()
    block = text.split("<!-- rules:begin -->")[1].split("<!-- rules:end -->")[0]
    return [(m[1].strip(), m[2], m[3]) for m in re.finditer(r"^\| (.+?) \| `(\w+)\.(\w+)` \|$", block, re.M)]


def test_every_rule_in_the_design_table_names_one_existing_core_function() -> None:
    rows = rule_table()
    assert len(rows) >= 15
    for rule, cls, fn in rows:
        assert cls in CLASSES, f"{rule}: {cls} is not a rule set of the core"
        assert fn in vars(CLASSES[cls]), f"{rule}: {cls}.{fn} does not exist (or is inherited)"
    assert len({(c, f) for _, c, f in rows}) == len(rows), "a function is named for two rules"
    assert issubclass(core.Router, RoutingRules) and issubclass(RoutingRules, AdmissionRules)


@pytest.mark.parametrize("impl", names("scripted"))
def test_swapping_a_rule_function_changes_every_shell(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    accept, forward = AdmissionRules.accept, RoutingRules.forward

    def strict_accept(self: Any, request_id: str, prompt: Any, **kw: Any) -> Any:
        if request_id.startswith("x"):
            raise ValueError("refused by the swapped admission rule")
        return accept(self, request_id, prompt, **kw)

    def tagged_forward(self: Any, req: Any, stage_id: int) -> list[Any]:
        return [Submit(a.stage_id, a.request_id, ("swapped", a.payload)) if type(a) is Submit else a
                for a in forward(self, req, stage_id)]

    monkeypatch.setattr(AdmissionRules, "accept", strict_accept)
    monkeypatch.setattr(RoutingRules, "forward", tagged_forward)
    with make_driver(impl, 2, {1}).start() as h:
        with pytest.raises(ValueError, match="swapped admission rule"):
            h.add_request("x1", "p")
        h.add_request("r1", "p")
        h.emit(0, "r1", "a", finished=True)
        assert h.wait_until(lambda: h.submissions(1) == [("r1", ("swapped", ["a"]))])
        h.emit(1, "r1", "done", finished=True)
        assert h.next_output().finished
        assert h.submissions(0) == [("r1", "p")]  # x1 never reached a stage
