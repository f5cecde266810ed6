"""A non-streamed chat answer's ``timings`` say where each stage ran, and whether failover moved it."""

from __future__ import annotations

from trio_orch.cluster.pool import StageTiming
from trio_orch.openai.chat import ChatStream, parse_chat_request
from trio_orch.openai.protocol import ServedModels


def test_timings_name_each_stage_s_replica_and_the_dead_one_it_was_failed_over_from() -> None:
    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]}, ServedModels("m"))
    cs = ChatStream(req)
    t0 = 100.0
    stages = [StageTiming(replica=1, t_submit=t0 + 0.001, t_first=t0 + 0.002, t_done=t0 + 0.003,
                          retried_from=0),  # its first replica died holding it
              None,  # a stage the request never reached
              StageTiming(replica=0, t_submit=t0 + 0.004)]
    out = cs.timings(t0, t0 + 0.01, stages)
    assert out["total_ms"] == 10.0
    placed = [(st["stage"], st["replica"], st["retried_from"]) for st in out["stages"]]
    assert placed == [(0, 1, 0), (2, 0, None)]
    assert out["stages"][0]["submitted_ms"] == 1.0 and out["stages"][0]["finished_ms"] == 3.0
