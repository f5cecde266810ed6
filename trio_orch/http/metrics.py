"""``/metrics``: the engine's snapshot exposed through ``prometheus_client``.

Nothing on the hot path talks to ``prometheus_client``: the engine, the
stage pools and the HTTP front count into plain integers and lock-free
:class:`~trio_orch.histogram.Histogram` objects, one
:class:`~trio_orch.engine.base.EngineStatistics` snapshot is taken per
scrape (in the orchestrator's thread), and :class:`EngineCollector` turns
that snapshot into metric families.  ``prometheus_client`` writes the text,
so types, ``_total`` suffixes, label escaping and histogram series are right
by construction.  :data:`FAMILIES` lists every family (docs/operating.md's list and
the tests read it); vLLM's families (``vllm:*``, with a ``model_name``
label) come from the same snapshot and the same front counts
(:mod:`trio_orch.http.vllm_metrics`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from stages.control import METHODS as RPC_METHODS
from trio_orch.histogram import RTF_BUCKETS, Histogram, HistogramSnapshot
from trio_orch.http.vllm_metrics import RequestStats, RequestTimer, VllmCollector
from trio_orch.types import ERROR_KINDS

if TYPE_CHECKING:
    from trio_orch.engine.api import EngineStatistics

__all__ = ["CONTENT_TYPE", "FAMILIES", "FINISH_REASONS", "EngineCollector", "ExtraCounters", "FrontMetrics",
           "render"]

log = logging.getLogger("trio_orch.http")

CONTENT_TYPE = CONTENT_TYPE_LATEST

#: name -> (help, {((label, value), ...): count}): counters kept elsewhere (the supervisor's)
ExtraCounters = Mapping[str, tuple[str, Mapping[tuple[tuple[str, str], ...], int]]]

#: every family this module emits: name -> (type, help)
FAMILIES: dict[str, tuple[str, str]] = {
    "trio_orch_up": ("gauge",
        "1 while the orchestrator runs"),
    "trio_orch_draining": ("gauge",
        "1 while shutting down: nothing new is accepted, requests in flight finish"),
    "trio_orch_active_requests": ("gauge",
        "accepted requests without their terminal yet"),
    "trio_orch_request_channel_depth": ("gauge",
        "accepted requests waiting in the request channel to start"),
    "trio_orch_admission_waiting": ("gauge",
        "requests waiting for room in the request channel (not accepted yet)"),
    "trio_orch_requests_queued": ("gauge",
        "requests waiting to start: in the request channel or for room in it"),
    "trio_orch_stage_inflight": ("gauge",
        "requests open on each stage (submitted, not finished)"),
    "trio_orch_stage_admitted": ("gauge",
        "started requests that still have to pass each stage (what its bound counts)"),
    "trio_orch_stage_max_inflight": ("gauge",
        "admission bound of each bounded stage: max_inflight per live replica times its "
        "live replicas"),
    "trio_orch_replica_inflight": ("gauge",
        "requests bound to each stage replica"),
    "trio_orch_stage_available": ("gauge",
        "1 while a stage has a live replica"),
    "trio_orch_stage_replicas": ("gauge",
        "replica slots of each stage"),
    "trio_orch_stage_replicas_live": ("gauge",
        "replicas of each stage that are ready for new requests"),
    "trio_orch_paused": ("gauge",
        "1 while the orchestrator is paused (nothing new starts), by pause mode (wait, abort, keep)"),
    "trio_orch_rpc_calls": ("counter",
        "collective RPCs made (control plane), by method"),
    "trio_orch_rpc_errors": ("counter",
        "replicas that answered a collective RPC with an error (timeout, failure), by method"),
    "trio_orch_requests_admitted": ("counter",
        "requests accepted by the orchestrator (each gets a terminal)"),
    "trio_orch_requests_retried": ("counter",
        "requests failed over: resent to a stage after the replica holding them died before "
        "answering them there, by stage"),
    "trio_orch_requests_shed": ("counter",
        "requests refused without being accepted, by reason (overloaded: no room within "
        "the admission bounds, HTTP 429; stage_unavailable: a stage of its path had no "
        "live replica, HTTP 503)"),
    "trio_orch_outputs_routed": ("counter",
        "outputs delivered to users (terminals included)"),
    "trio_orch_dropped_outputs": ("counter",
        "stage outputs dropped because their request was unknown or ended"),
    "trio_orch_terminals": ("counter",
        "request terminals by kind (finished or an error kind)"),
    "trio_orch_errors": ("counter",
        "error terminals by kind"),
    "trio_orch_http_requests": ("counter",
        "chat completion requests by HTTP status (500: unexpected errors)"),
    "trio_orch_prompt_tokens": ("counter",
        "prompt tokens of the requests the HTTP routes passed to the engine (usage's prompt_tokens)"),
    "trio_orch_generation_tokens": ("counter",
        "text tokens sent to clients, by the stage that generated them (usage's completion_tokens)"),
    "trio_orch_request_success": ("counter",
        "answered requests by finish reason (stop, length; abort: the client left first)"),
    "trio_orch_http_body_reads": ("gauge",
        "request bodies being read now (each holds one of --max-body-reads slots)"),
    "trio_orch_http_client_disconnects": ("counter",
        "clients that left before their answer (request aborted) or during their upload"),
    "trio_orch_dispatch_latency_seconds": ("histogram",
        "a stage produced an output -> the consumer took it"),
    "trio_orch_time_to_first_output_seconds": ("histogram",
        "request arrival -> the first output of each final stage (text: time to first "
        "token; audio: time to first audio)"),
    "trio_orch_request_duration_seconds": ("histogram",
        "request arrival -> its terminal, by terminal kind"),
    "trio_orch_stage_queue_seconds": ("histogram",
        "seconds a request waited in a stage worker before its batch took it (reported by "
        "the workers)"),
    "trio_orch_stage_compute_seconds": ("histogram",
        "seconds a request spent in a stage worker's batch (reported by the workers)"),
    "trio_orch_stage_transfer_seconds": ("histogram",
        "seconds from a request's finishing output of one stage to its submit to the next (the "
        "head's hand-off: the forward, the routing decision, the encoding), by edge"),
    "trio_orch_stage_transfer_bytes": ("counter",
        "bytes of the inputs the head sent a stage's workers, made of the stage before's outputs, "
        "by edge"),
    "trio_orch_audio_real_time_factor": ("histogram",
        "seconds from a request's arrival to its last audio output per second of audio (< "
        "1: faster than real time)"),
}


#: the finish reasons ``trio_orch_request_success`` shows from the start (vLLM's)
FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class FrontMetrics:
    """What the HTTP front counts itself (on its event loop)."""

    requests: dict[tuple[str, int], int] = field(default_factory=dict)  #: (route, status) -> count
    disconnects: int = 0
    body_reads: int = 0  #: request bodies being read now (holding a read slot)
    #: POSTs to a generation route let in and not answered yet (the Shedder's count of those on their way)
    pending: int = 0
    shed: int = 0  #: refused by the front itself while the engine was shedding (counted as overloaded)
    rtf: Histogram = field(default_factory=lambda: Histogram(RTF_BUCKETS))
    draining: bool = False
    prompt_tokens: int = 0
    generation_tokens: dict[int, int] = field(default_factory=dict)  #: stage -> tokens sent to clients
    #: finish reason -> answered requests (the reasons listed are shown from the start, at 0)
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    model_name: str = "trio-orch"  #: the ``model_name`` label of the ``vllm:*`` families
    #: the per-request histograms of the ``vllm:*`` families (:meth:`serve_model` sizes them)
    per_request: RequestStats = field(default_factory=RequestStats)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def serve_model(self, name: str, max_model_len: int | None) -> None:
        """The served model: its name labels the ``vllm:*`` families, its context sizes the token
        buckets (called once, before any request)."""
        self.model_name = name
        self.per_request = RequestStats(max_model_len)

    def timer(self, t_open: float) -> RequestTimer:
        """A text request's timer (arrived at ``t_open``, ``time.perf_counter``) for the ``vllm:*``
        per-request histograms."""
        return RequestTimer(self.per_request, t_open)

    def expect_stage(self, stage: int) -> None:
        """Show ``stage``'s generated tokens from the start (at 0), before any request."""
        with self._lock:
            self.generation_tokens.setdefault(stage, 0)

    def count_tokens(self, prompt: int, generated: Mapping[int, int]) -> None:
        """One request's prompt tokens and the tokens each stage generated for it."""
        with self._lock:
            self.prompt_tokens += prompt
            for k, n in generated.items():
                self.generation_tokens[k] = self.generation_tokens.get(k, 0) + n

    def count_finished(self, reason: str) -> None:
        """A request answered to its end (``stop``, ``length``) or left by its client (``abort``)."""
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def client_left(self, route: str) -> None:
        """A client of ``route`` left before its answer and its request was aborted: the one place that
        counts it (a disconnect, a request finished by ``abort``) and says so, for every route."""
        with self._lock:
            self.disconnects += 1
            self.finished["abort"] = self.finished.get("abort", 0) + 1
        log.info("%s: a client disconnected before its answer; its request was aborted", route)

    def count(self, route: str, status: int) -> None:
        key = (route, status)
        with self._lock:  # a front may count from more than one thread
            self.requests[key] = self.requests.get(key, 0) + 1

    def counts(self) -> dict[str, Any]:
        """Its counters as plain data (what an API-server process hands the head to sum)."""
        with self._lock:
            return {"requests": [[route, status, n] for (route, status), n in self.requests.items()],
                    "disconnects": self.disconnects, "pending": self.pending, "shed": self.shed,
                    "rtf": self.rtf.snapshot(), "prompt_tokens": self.prompt_tokens,
                    "generation_tokens": dict(self.generation_tokens), "finished": dict(self.finished)}

    @classmethod
    def summed(cls, counts: Iterable[Mapping[str, Any]], *, draining: bool = False) -> FrontMetrics:
        """The sum of several fronts' :meth:`counts` (the whole server's, for ``/metrics``)."""
        out = cls(draining=draining)
        for c in counts:
            for route, status, n in c["requests"]:
                out.requests[(route, status)] = out.requests.get((route, status), 0) + n
            out.disconnects += c["disconnects"]
            out.pending += c["pending"]
            out.shed += c["shed"]
            rtf = c["rtf"]
            if isinstance(rtf, Mapping):  # as it crossed a process boundary: plain data
                rtf = HistogramSnapshot(tuple((le, n) for le, n in rtf["buckets"]), rtf["sum"], rtf["count"])
            out.rtf.add(rtf)
            out.prompt_tokens += c["prompt_tokens"]
            for k, n in c["generation_tokens"].items():
                out.generation_tokens[int(k)] = out.generation_tokens.get(int(k), 0) + n
            for reason, n in c["finished"].items():
                out.finished[reason] = out.finished.get(reason, 0) + n
        return out

    def count_shed(self, route: str, n: int = 1) -> None:
        """``n`` requests the front refused itself because the engine would shed them (429s)."""
        with self._lock:
            self.shed += n
            key = (route, 429)
            self.requests[key] = self.requests.get(key, 0) + n


def _gauge(name: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, FAMILIES[name][1], labels=list(labels))


def _counter(name: str, labels: Sequence[str] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(name, FAMILIES[name][1], labels=list(labels))


def _histogram(name: str, labels: Sequence[str], snaps: Mapping[tuple[str, ...], HistogramSnapshot | None]
               ) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, FAMILIES[name][1], labels=list(labels))
    for values, snap in snaps.items():
        if snap is not None:
            fam.add_metric(list(values), [(floatToGoString(le), n) for le, n in snap.buckets], snap.sum)
    return fam


class EngineCollector(Collector):
    """Metric families from one engine snapshot, the front's counters and extra counters.

    ``outputs`` is each stage's output modality (labels the time-to-first-output
    histogram); None leaves the label ``data``.
    """

    def __init__(self, stats: EngineStatistics, front: FrontMetrics | None = None,
                 extra: ExtraCounters | None = None, outputs: Sequence[str] | None = None) -> None:
        self.stats = stats
        self.front = front
        self.extra = extra or {}
        self.outputs = outputs

    def collect(self) -> Iterator[Metric]:
        st = self.stats
        yield from self._gauges(st)
        c = _counter("trio_orch_requests_admitted")
        c.add_metric([], st.admitted)
        yield c
        c = _counter("trio_orch_requests_shed", ["reason"])
        front_shed = self.front.shed if self.front is not None else 0
        for reason in sorted({"overloaded", "stage_unavailable", *st.shed_by_reason}):
            extra = front_shed if reason == "overloaded" else 0
            c.add_metric([reason], st.shed_by_reason.get(reason, 0) + extra)
        yield c
        c = _counter("trio_orch_requests_retried", ["stage"])
        for k, n in enumerate(st.orchestrator.core.retried_by_stage if st.orchestrator else ()):
            c.add_metric([str(k)], n)
        yield c
        c = _counter("trio_orch_outputs_routed")
        c.add_metric([], st.outputs_routed)
        yield c
        orch = st.orchestrator
        for name, counts in (("trio_orch_rpc_calls", orch.rpc_calls if orch else {}),
                             ("trio_orch_rpc_errors", orch.rpc_errors if orch else {})):
            c = _counter(name, ["method"])
            for method, n in sorted({**dict.fromkeys(RPC_METHODS, 0), **counts}.items()):  # 0 from the start
                c.add_metric([method], n)
            yield c
        c = _counter("trio_orch_dropped_outputs")
        c.add_metric([], st.dropped_outputs)
        yield c
        for name, values in (("trio_orch_terminals", st.terminals_by_kind),
                             ("trio_orch_errors", {**dict.fromkeys(ERROR_KINDS, 0), **st.errors_by_kind})):
            c = _counter(name, ["kind"])
            for kind, n in sorted(values.items()):
                c.add_metric([kind], n)
            yield c
        if self.front is not None:
            c = _counter("trio_orch_http_requests", ["route", "status"])
            for (route, status), n in sorted(self.front.requests.items()):
                c.add_metric([route, str(status)], n)
            yield c
            c = _counter("trio_orch_prompt_tokens")
            c.add_metric([], self.front.prompt_tokens)
            yield c
            c = _counter("trio_orch_generation_tokens", ["stage"])
            for k, n in sorted(self.front.generation_tokens.items()):
                c.add_metric([str(k)], n)
            yield c
            c = _counter("trio_orch_request_success", ["finished_reason"])
            for reason, n in sorted(self.front.finished.items()):
                c.add_metric([reason], n)
            yield c
            c = _counter("trio_orch_http_client_disconnects")
            c.add_metric([], self.front.disconnects)
            yield c
            g = _gauge("trio_orch_http_body_reads")
            g.add_metric([], self.front.body_reads)
            yield g
        for name, (help_text, values) in self.extra.items():
            items = sorted(values.items())
            labels = [k for k, _ in items[0][0]] if items else []
            c = CounterMetricFamily(name, help_text, labels=labels)
            for pairs, n in items:
                c.add_metric([v for _, v in pairs], n)
            yield c
        yield from self._histograms(st)

    def _gauges(self, st: EngineStatistics) -> Iterator[Metric]:
        for name, value in (("trio_orch_up", 1 if st.running else 0),
                            ("trio_orch_draining", 1 if st.draining or (self.front and self.front.draining)
                             else 0),
                            ("trio_orch_active_requests", st.active_requests),
                            ("trio_orch_request_channel_depth", st.queued_requests),
                            ("trio_orch_admission_waiting", st.admission_waiting),
                            ("trio_orch_requests_queued", st.queued_requests + st.admission_waiting)):
            g = _gauge(name)
            g.add_metric([], value)
            yield g
        per_stage = {
            "trio_orch_stage_inflight": st.inflight_by_stage,
            "trio_orch_stage_admitted": st.admitted_by_stage,
            "trio_orch_stage_available": tuple(1 if a else 0 for a in st.stage_available),
            "trio_orch_stage_replicas": tuple(total for _, total in st.replicas),
            "trio_orch_stage_replicas_live": tuple(live for live, _ in st.replicas),
        }
        for name, values in per_stage.items():
            g = _gauge(name, ["stage"])
            for k, v in enumerate(values):
                g.add_metric([str(k)], v)
            yield g
        g = _gauge("trio_orch_stage_max_inflight", ["stage"])
        for k, limit in enumerate(st.stage_limits):
            if limit is not None:
                g.add_metric([str(k)], limit)
        yield g
        paused = st.orchestrator.paused if st.orchestrator else None
        g = _gauge("trio_orch_paused", ["mode"])
        for mode in ("wait", "abort", "keep"):
            g.add_metric([mode], 1 if paused == mode else 0)
        yield g
        g = _gauge("trio_orch_replica_inflight", ["stage", "replica"])
        for (k, r), n in sorted(st.inflight_by_replica.items()):
            g.add_metric([str(k), r], n)
        yield g

    def _histograms(self, st: EngineStatistics) -> Iterator[Metric]:
        yield _histogram("trio_orch_dispatch_latency_seconds", [], {(): st.dispatch_latency})
        out = self.outputs
        yield _histogram("trio_orch_time_to_first_output_seconds", ["stage", "output"],
                         {(str(k), out[k] if out is not None and k < len(out) else "data"): h
                          for k, h in st.first_output.items()})
        yield _histogram("trio_orch_request_duration_seconds", ["kind"],
                         {(kind,): h for kind, h in st.duration.items()})
        yield _histogram("trio_orch_stage_queue_seconds", ["stage"],
                         {(str(k),): h for k, h in st.stage_queue.items()})
        yield _histogram("trio_orch_stage_compute_seconds", ["stage"],
                         {(str(k),): h for k, h in st.stage_compute.items()})
        edge = ["from_stage", "to_stage"]
        yield _histogram("trio_orch_stage_transfer_seconds", edge,
                         {(str(k - 1), str(k)): h for k, h in st.stage_transfer.items() if k > 0})
        c = _counter("trio_orch_stage_transfer_bytes", edge)
        for k, n in sorted(st.stage_input_bytes.items()):
            if k > 0:
                c.add_metric([str(k - 1), str(k)], n)
        yield c
        if self.front is not None:
            yield _histogram("trio_orch_audio_real_time_factor", [], {(): self.front.rtf.snapshot()})


def render(stats: EngineStatistics, front: FrontMetrics | None = None, extra: ExtraCounters | None = None,
           outputs: Sequence[str] | None = None) -> bytes:
    """The Prometheus text exposition of one snapshot (a fresh registry per scrape).

    A snapshot that carries the fronts' counters (``stats.fronts``: the sum over every API-server
    process, taken by the head) shows those instead of ``front``'s own.
    """
    if stats.fronts is not None:
        front = FrontMetrics.summed([stats.fronts], draining=front.draining if front is not None else False)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats, front, extra, outputs))
    if front is not None:
        registry.register(VllmCollector(stats, front))
    return generate_latest(registry)
