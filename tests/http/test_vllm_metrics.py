"""``/metrics`` speaks vLLM's names: a stock vLLM dashboard's queries find their series here.

:data:`DASHBOARD` is every series the stock Grafana dashboard vLLM ships
(``examples/observability/prometheus_grafana/grafana.json``) queries, each
filtered by ``model_name``; the tests scrape ``/metrics`` with
``prometheus_client``'s parser on both fronts -- before any request (vLLM's
families exist from start-up) and after chat requests (they count them) --
and check vLLM's types and buckets.  A pipeline of worker processes adds
what stages that time their requests give: queue, prefill and inference
times, and the hand-off of each request from one stage to the next
(``trio_orch_stage_transfer_*``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stages.config import PipelineConfig, StageConfig
from tests.http_helpers import FRONTS, HANG, chat, sse_events, worker_server
from trio_orch.http.vllm_metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    VLLM_FAMILIES,
    RequestStats,
    RequestTimer,
    token_buckets,
)
from trio_orch.testing.toy_pipeline import toy_pipeline

#: the series the stock vLLM Grafana dashboard queries (its panels' ``expr``s), each with ``model_name``
DASHBOARD = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)

SERVES = pytest.mark.processes  # a real server on loopback


def scrape(client: httpx.Client) -> dict[str, list[Any]]:
    """``/metrics`` parsed by prometheus_client: sample name -> its samples."""
    r = client.get("/metrics")
    assert r.status_code == 200
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    found = [s.value for s in samples[name] if labels.items() <= s.labels.items()]
    assert len(found) == 1, (name, labels, samples.get(name))
    return float(found[0])


def check_dashboard(samples: dict[str, list[Any]], model: str) -> None:
    """Every dashboard series is there, each sample labelled with the served model."""
    missing = [name for name in DASHBOARD if name not in samples]
    assert missing == []
    for name in DASHBOARD:
        assert all(s.labels.get("model_name") == model for s in samples[name]), name


def test_token_buckets_are_vllms_1_2_5_steps_up_to_the_context() -> None:
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(256) == (1, 2, 5, 10, 20, 50, 100, 200)
    assert token_buckets(1) == (1,)


def test_a_request_timer_measures_the_phases_vllm_names() -> None:
    """Queue = arrival -> submit to stage 0; prefill = submit -> first token; decode = first -> last
    token; inference = submit -> last token; inter-token gaps between the outputs that carry tokens."""
    stats = RequestStats(max_model_len=64)
    timer = RequestTimer(stats, t_open=10.0)
    timer.saw(0, now=10.5)  # an output without a token: no first token yet
    timer.saw(1, now=11.0)
    timer.saw(3, now=11.5)  # two tokens in one output: one gap
    timer.saw(3, now=12.0)  # nothing new
    timer.saw(4, now=12.5)

    class Timing:
        t_submit = 10.25

    timer.finish(prompt_tokens=20, max_tokens=None, token_limit=8, timings=[Timing(), None], now=13.0)
    h = {name: hist.snapshot() for name, hist in stats.histograms.items()}
    ttft, itl = h["vllm:time_to_first_token_seconds"], h["vllm:inter_token_latency_seconds"]
    assert (ttft.count, ttft.sum, itl.count, itl.sum) == (1, 1.0, 2, 1.5)
    assert h["vllm:e2e_request_latency_seconds"].sum == 3.0
    assert h["vllm:request_queue_time_seconds"].sum == 0.25
    assert h["vllm:request_prefill_time_seconds"].sum == 0.75
    assert h["vllm:request_decode_time_seconds"].sum == 1.5
    assert h["vllm:request_inference_time_seconds"].sum == 2.25
    assert h["vllm:request_time_per_output_token_seconds"].sum == 0.5  # 1.5 s over 3 gaps
    assert (h["vllm:request_prompt_tokens"].sum, h["vllm:request_generation_tokens"].sum) == (20, 4)
    assert h["vllm:request_max_num_generation_tokens"].sum == 8  # the stage's cap: no max_tokens given
    assert h["vllm:request_params_max_tokens"].count == 0
    assert [le for le, _ in h["vllm:request_prompt_tokens"].buckets][:-1] == [1, 2, 5, 10, 20, 50]
    # untimed stages (an in-process pipeline): the phases that need the submit are left out
    RequestTimer(stats, t_open=0.0).finish(prompt_tokens=1, max_tokens=5, token_limit=None, timings=None,
                                          now=1.0)
    assert stats.histograms["vllm:request_queue_time_seconds"].count == 1
    assert stats.histograms["vllm:e2e_request_latency_seconds"].count == 2
    assert stats.histograms["vllm:request_params_max_tokens"].sum == 5


@SERVES
@pytest.mark.parametrize("front", FRONTS)
def test_a_stock_vllm_dashboards_series_are_served_from_start_up_and_count_chat_requests(
        front: str, serving: Callable[..., Any]) -> None:
    s = serving(front, toy_pipeline(token_delay=0.001, audio_delay=0.001), model_name="toy-model")
    with httpx.Client(base_url=s.url, timeout=HANG) as c:
        before = scrape(c)
        check_dashboard(before, "toy-model")  # from start-up, at 0
        assert value(before, "vllm:request_success_total", finished_reason="stop") == 0
        assert value(before, "vllm:e2e_request_latency_seconds_count") == 0
        r = c.post("/v1/chat/completions", json=chat("one two three", model="toy-model"))
        assert r.status_code == 200
        usage = r.json()["usage"]
        streamed = chat("four five", model="toy-model", stream=True)
        with c.stream("POST", "/v1/chat/completions", json=streamed) as resp:
            events = sse_events(resp.iter_lines())
        assert events[-1] == "[DONE]"
        after = scrape(c)
    check_dashboard(after, "toy-model")
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(s.url + "/metrics").text)}
    for name, (kind, _) in VLLM_FAMILIES.items():
        assert families[name].type == kind, name
    finished = sum(value(after, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length"))
    assert finished == 2
    assert value(after, "vllm:e2e_request_latency_seconds_count") == 2
    assert value(after, "vllm:time_to_first_token_seconds_count") == 2
    assert value(after, "vllm:request_generation_tokens_count") == 2
    assert value(after, "vllm:inter_token_latency_seconds_count") >= usage["completion_tokens"] - 1
    assert value(after, "vllm:prompt_tokens_total") >= usage["prompt_tokens"]
    assert value(after, "vllm:generation_tokens_total") == value(after, "vllm:request_generation_tokens_sum")
    assert value(after, "vllm:num_requests_running") == 0
    # vLLM's buckets, not ours
    for name, bounds in (("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
                         ("vllm:inter_token_latency_seconds", ITL_BUCKETS),
                         ("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS)):
        les = [float(b.labels["le"]) for b in after[f"{name}_bucket"]]
        assert les == [*bounds, float("inf")], name


SMALL = {"d_model": 32, "layers": 1, "heads": 2}
SPEECH = PipelineConfig([StageConfig("thinker", model=SMALL), StageConfig("talker", model=SMALL),
                         StageConfig("code2wav", model={"dim": 16})], final_stage_ids=[0, 2]).validate()


@SERVES
def test_worker_stages_give_queue_and_prefill_times_and_each_hand_off_is_timed_and_sized() -> None:
    for served in worker_server("trio", SPEECH):
        with httpx.Client(base_url=served.url, timeout=HANG) as c:
            before = scrape(c)
            for edge in (("0", "1"), ("1", "2")):  # every edge from start-up, at 0
                labels = dict(zip(("from_stage", "to_stage"), edge, strict=True))
                assert value(before, "trio_orch_stage_transfer_seconds_count", **labels) == 0
                assert value(before, "trio_orch_stage_transfer_bytes_total", **labels) == 0
            r = c.post("/v1/chat/completions", json=chat("hello there", model="tiny", max_tokens=6,
                                                         modalities=["text", "audio"]))
            assert r.status_code == 200, r.text
            after = scrape(c)
    for edge in (("0", "1"), ("1", "2")):  # the thinker's tokens to the talker, its codes to the vocoder
        labels = dict(zip(("from_stage", "to_stage"), edge, strict=True))
        assert value(after, "trio_orch_stage_transfer_seconds_count", **labels) == 1
        assert value(after, "trio_orch_stage_transfer_bytes_total", **labels) > 0
    for name in ("queue_time", "prefill_time", "inference_time", "decode_time"):
        assert value(after, f"vllm:request_{name}_seconds_count", model_name="tiny") == 1, name
    assert value(after, "vllm:request_params_max_tokens_sum") == 6
    assert value(after, "vllm:request_max_num_generation_tokens_sum") == 6
