"""Labelled counters have a sample for every label value known at start, at 0, before their first event.

Prometheus' ``rate()`` over a series that does not exist yet says "no data",
not 0, so an alert on errors or restarts stays silent until after the first
one.  An idle in-process engine's ``/metrics`` text, and a supervisor over a
real two-stage echo pipeline that has seen no death.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from stages.config import echo_config
from stages.control import METHODS
from trio_orch.cluster.credentials import REFUSALS
from trio_orch.cluster.supervisor import CAUSES, supervised_pipeline
from trio_orch.engine import ThreadEngine
from trio_orch.http.metrics import render
from trio_orch.testing.toy_pipeline import toy_pipeline
from trio_orch.types import ERROR_KINDS


def samples(text: bytes, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    fams = {f.name: f for f in text_string_to_metric_families(text.decode())}
    return {tuple(sorted(s.labels.items())): s.value for s in fams[family].samples
            if s.name.endswith("_total")}


def test_error_and_rpc_counters_start_at_zero_for_every_kind_and_method() -> None:
    with ThreadEngine(toy_pipeline(token_delay=0.001, audio_delay=0.001)) as engine:
        text = render(engine.stats())
    assert samples(text, "trio_orch_errors") == {(("kind", k),): 0 for k in ERROR_KINDS}
    for family in ("trio_orch_rpc_calls", "trio_orch_rpc_errors"):
        assert samples(text, family) == {(("method", m),): 0 for m in METHODS}


async def test_the_supervisors_counters_start_at_zero_for_every_stage_and_cause() -> None:
    async with supervised_pipeline(echo_config(2)) as pipe:
        fams = pipe.supervisor.prometheus_counters()
    for name in ("deaths", "restarts", "restart_failures", "gave_up"):
        assert fams[f"trio_orch_supervisor_{name}"][1] == {
            (("stage", str(k)), ("cause", c)): 0 for k in (0, 1) for c in CAUSES}
    # nobody tried to take a worker's place: every such refusal is there, at 0
    assert fams["trio_orch_auth_refused"][1] == {(("reason", r),): 0 for r in REFUSALS}
