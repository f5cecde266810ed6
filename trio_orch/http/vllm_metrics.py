"""vLLM's metric families (``vllm:*``), served on ``/metrics`` beside the project's own ``trio_orch_*``.

A team that watches ``vllm serve`` with a stock dashboard or its alerts
points them here unchanged: every family :data:`VLLM_FAMILIES` lists has
vLLM's name, type, help, buckets and labels (``model_name``: the first
served name; ``engine``: ``"0"``, the one engine of this head), and is
present from start-up, at 0, as vLLM's are.  What the numbers mean here:

- scheduler state from the engine snapshot: ``vllm:num_requests_running``
  (requests started and not ended: what ``serve --max-num-seqs`` bounds),
  ``vllm:num_requests_waiting`` (waiting to start: in the request channel or
  for room in it);
- token counters and request outcomes from the HTTP routes' own counts
  (:class:`~trio_orch.http.metrics.FrontMetrics`: the same numbers as
  ``trio_orch_prompt_tokens_total`` and friends);
- per-request histograms, measured by the text routes (chat, completions)
  for each request that ends with a finish reason (:class:`RequestTimer`):
  time to first token and between tokens as the route receives them, end to
  end from the request's arrival; queue time (arrival -> its submit to stage
  0), prefill (-> its first token), decode (first -> last token) and
  inference (submit -> last token) where the stages time their requests
  (worker stages; an in-process pipeline leaves those four empty);
- what this server has not: a paged KV cache (``vllm:kv_cache_usage_perc``
  stays 0), a prefix cache (its counters stay 0), preemption
  (``vllm:num_preemptions_total`` stays 0).

Everything is counted in plain integers and lock-free
:class:`~trio_orch.histogram.Histogram` s (mergeable: several front
processes can add theirs up) and turned into families once per scrape by
:class:`VllmCollector`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from trio_orch.histogram import Histogram

if TYPE_CHECKING:
    from trio_orch.engine.api import EngineStatistics
    from trio_orch.http.metrics import FrontMetrics

__all__ = ["DEFAULT_MAX_MODEL_LEN", "ITL_BUCKETS", "REQUEST_LATENCY_BUCKETS", "TTFT_BUCKETS", "VLLM_FAMILIES",
           "VLLM_FINISH_REASONS", "RequestStats", "RequestTimer", "VllmCollector", "token_buckets"]

#: vLLM's finish reasons, each shown from the start (at 0); ``error`` and ``repetition`` are not
#: produced here (a failed request is ``trio_orch_errors_total{kind}``)
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

#: vLLM's buckets (``vllm/v1/metrics/loggers.py``): seconds to the first token
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
#: seconds between tokens (and a request's mean of it)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
#: seconds of a request's phases: end to end, queued, prefill, decode, inference
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
#: the ``n`` request parameter
N_BUCKETS = (1, 2, 5, 10, 20)
#: the context the token-count buckets reach when the pipeline reports none (toy pipelines)
DEFAULT_MAX_MODEL_LEN = 65536


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


#: every family: name (as vLLM writes it: a counter without ``_total``) -> (type, help)
VLLM_FAMILIES: dict[str, tuple[str, str]] = {
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("gauge",
        "KV-cache usage. 1 means 100 percent usage. (No paged KV cache here: always 0.)"),
    "vllm:prefix_cache_queries": ("counter",
        "Prefix cache queries, in terms of number of queried tokens. (No prefix cache here.)"),
    "vllm:prefix_cache_hits": ("counter",
        "Prefix cache hits, in terms of number of cached tokens. (No prefix cache here.)"),
    "vllm:num_preemptions": ("counter",
        "Cumulative number of preemption from the engine. (Nothing is preempted here.)"),
    "vllm:prompt_tokens": ("counter", "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("counter", "Number of generation tokens processed."),
    "vllm:request_success": ("counter", "Count of successfully processed requests."),
    "vllm:request_prompt_tokens": ("histogram", "Number of prefill tokens processed."),
    "vllm:request_generation_tokens": ("histogram", "Number of generation tokens processed."),
    "vllm:request_max_num_generation_tokens": ("histogram",
        "Histogram of maximum number of requested generation tokens."),
    "vllm:request_params_n": ("histogram", "Histogram of the n request parameter."),
    "vllm:request_params_max_tokens": ("histogram", "Histogram of the max_tokens request parameter."),
    "vllm:time_to_first_token_seconds": ("histogram", "Histogram of time to first token in seconds."),
    "vllm:inter_token_latency_seconds": ("histogram", "Histogram of inter-token latency in seconds."),
    "vllm:request_time_per_output_token_seconds": ("histogram",
        "Histogram of time_per_output_token_seconds per request."),
    "vllm:e2e_request_latency_seconds": ("histogram", "Histogram of e2e request latency in seconds."),
    "vllm:request_queue_time_seconds": ("histogram", "Histogram of time spent in WAITING phase for request."),
    "vllm:request_inference_time_seconds": ("histogram",
        "Histogram of time spent in RUNNING phase for request."),
    "vllm:request_prefill_time_seconds": ("histogram",
        "Histogram of time spent in PREFILL phase for request."),
    "vllm:request_decode_time_seconds": ("histogram", "Histogram of time spent in DECODE phase for request."),
}

#: the labels of every family (``vllm:request_success`` adds ``finished_reason``)
LABELS = ("model_name", "engine")
#: the ``engine`` label's value: one engine per head
ENGINE = "0"


class RequestStats:
    """The per-request histograms, one set per served app; observed from the routes without a lock.

    ``max_model_len`` decides the token-count buckets (vLLM's: 1-2-5 steps up to the context).
    """

    def __init__(self, max_model_len: int | None = None) -> None:
        self.max_model_len = max_model_len
        tokens = token_buckets(max_model_len or DEFAULT_MAX_MODEL_LEN)
        self.histograms: dict[str, Histogram] = {
            "vllm:request_prompt_tokens": Histogram(tokens),
            "vllm:request_generation_tokens": Histogram(tokens),
            "vllm:request_max_num_generation_tokens": Histogram(tokens),
            "vllm:request_params_n": Histogram(N_BUCKETS),
            "vllm:request_params_max_tokens": Histogram(tokens),
            "vllm:time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "vllm:inter_token_latency_seconds": Histogram(ITL_BUCKETS),
            "vllm:request_time_per_output_token_seconds": Histogram(ITL_BUCKETS),
            **{name: Histogram(REQUEST_LATENCY_BUCKETS) for name in (
                "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
                "vllm:request_decode_time_seconds")},
        }

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)


class RequestTimer:
    """One text request's times as its route sees them (``time.perf_counter``), into ``stats``.

    :meth:`saw` after each output the route took, with the request's tokens so
    far (the first that carries one is its first token, each later one an
    inter-token gap); :meth:`finish` when it ended with a finish reason.
    """

    __slots__ = ("stats", "t_first", "t_last", "t_open", "tokens")

    def __init__(self, stats: RequestStats, t_open: float) -> None:
        self.stats = stats
        self.t_open = t_open
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.tokens = 0

    def saw(self, tokens: int, now: float | None = None) -> None:
        """The request has generated ``tokens`` so far (an output just reached the route, at ``now``)."""
        if tokens <= self.tokens:
            return
        now = perf_counter() if now is None else now
        if self.t_last is None:
            self.t_first = now
            self.stats.observe("vllm:time_to_first_token_seconds", now - self.t_open)
        else:
            self.stats.observe("vllm:inter_token_latency_seconds", now - self.t_last)
        self.t_last = now
        self.tokens = tokens

    def finish(self, *, prompt_tokens: int, max_tokens: int | None, token_limit: int | None,
               timings: Sequence[Any] | None, now: float | None = None) -> None:
        """The request ended with a finish reason: its sizes and phases.

        ``max_tokens``: the request's own cap (None: not given); ``token_limit``
        the text stage's; ``timings``: each stage's timing (the first stage's
        ``t_submit`` is when it left the queue; None where not timed).
        """
        now = perf_counter() if now is None else now
        observe = self.stats.observe
        generated = self.tokens
        observe("vllm:e2e_request_latency_seconds", now - self.t_open)
        observe("vllm:request_prompt_tokens", prompt_tokens)
        observe("vllm:request_generation_tokens", generated)
        observe("vllm:request_params_n", 1)
        if max_tokens is not None:
            observe("vllm:request_params_max_tokens", max_tokens)
        caps = [n for n in (max_tokens, token_limit) if n is not None]
        context = self.stats.max_model_len
        if caps or context is not None:
            observe("vllm:request_max_num_generation_tokens",
                    min(caps) if caps else max(0, context - prompt_tokens))  # type: ignore[operator]
        first, last = self.t_first, self.t_last
        decode = (last - first) if first is not None and last is not None else 0.0
        observe("vllm:request_decode_time_seconds", decode)
        per_token = decode / (generated - 1) if generated > 1 else 0.0
        observe("vllm:request_time_per_output_token_seconds", per_token)
        start = timings[0].t_submit if timings and timings[0] is not None else None
        if start is not None:
            observe("vllm:request_queue_time_seconds", max(0.0, start - self.t_open))
            end = last if last is not None else now
            observe("vllm:request_inference_time_seconds", max(0.0, end - start))
            first_token = first if first is not None else end
            observe("vllm:request_prefill_time_seconds", max(0.0, first_token - start))


_KINDS: dict[str, Any] = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily,
                          "histogram": HistogramMetricFamily}


def _family(name: str, labels: Sequence[str] = LABELS) -> Metric:
    kind, help_text = VLLM_FAMILIES[name]
    return _KINDS[kind](name, help_text, labels=list(labels))


class VllmCollector(Collector):
    """The ``vllm:*`` families from one engine snapshot and the front's counts (see the module docstring)."""

    def __init__(self, stats: EngineStatistics, front: FrontMetrics) -> None:
        self.stats = stats
        self.front = front

    def collect(self) -> Iterator[Metric]:
        st, front = self.stats, self.front
        labels = [front.model_name, ENGINE]
        values: dict[str, float] = {
            "vllm:num_requests_running": st.active_requests - st.queued_requests,
            "vllm:num_requests_waiting": st.queued_requests + st.admission_waiting,
            "vllm:kv_cache_usage_perc": 0,
            "vllm:prefix_cache_queries": 0,
            "vllm:prefix_cache_hits": 0,
            "vllm:num_preemptions": 0,
            "vllm:prompt_tokens": front.prompt_tokens,
            "vllm:generation_tokens": sum(front.generation_tokens.values()),
        }
        for name, value in values.items():
            fam = _family(name)
            fam.add_metric(labels, value)  # type: ignore[attr-defined]
            yield fam
        success = _family("vllm:request_success", [*LABELS, "finished_reason"])
        finished = {**dict.fromkeys(VLLM_FINISH_REASONS, 0), **front.finished}
        for reason, n in finished.items():
            success.add_metric([*labels, reason], n)  # type: ignore[attr-defined]
        yield success
        for name, hist in front.per_request.histograms.items():
            snap = hist.snapshot()
            fam = _family(name)
            fam.add_metric(labels, [(floatToGoString(le), n) for le, n in snap.buckets],  # type: ignore[attr-defined]
                           snap.sum)
            yield fam
