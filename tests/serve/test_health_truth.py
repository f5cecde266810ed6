"""``/health`` tells the truth about time: a hung replica is suspect at once, a given-up slot says so.

Real echo worker processes under the supervisor, served over HTTP on
loopback.  A replica is hung with SIGSTOP (and woken with SIGCONT); a slot is
given up by a replacement that always fails at startup.  Every wait is on a
condition, bounded; nothing about timing is asserted.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from stages.config import PipelineConfig, echo_config
from stages.registry import outputs_of
from tests.http_helpers import HANG, Served, chat, wait_until
from trio_orch.cluster.supervisor import ExtraArgs, RestartPolicy, supervised_pipeline
from trio_orch.engine import ThreadEngine
from trio_orch.testing import worker_alive


@contextlib.contextmanager
def supervised(cfg: PipelineConfig, policy: RestartPolicy,
               extra_args: ExtraArgs | None = None) -> Iterator[tuple[Served, Any]]:
    """The pipeline under the supervisor behind the app on uvicorn: (served, pipeline)."""
    holder: list[Any] = []

    @asynccontextmanager
    async def factory() -> AsyncIterator[Any]:
        async with supervised_pipeline(cfg, policy, extra_args=extra_args) as pipe:
            holder.append(pipe)
            yield pipe

    served = Served(ThreadEngine(factory, startup_timeout=60).start(),  # serves "toy", as chat() asks
                    outputs=outputs_of(s.kind for s in cfg.stages))
    try:
        yield served, holder[0]
    finally:
        served.stop()


def health(c: httpx.Client) -> tuple[int, dict[str, Any]]:
    r = c.get("/health")
    return r.status_code, r.json()


def states(body: dict[str, Any], stage: int) -> list[str]:
    return [rep["state"] for rep in body["stages"][stage]["replicas"]]


def poll_until(c: httpx.Client, pred: Callable[[int, dict[str, Any]], bool], what: str,
               hang: float = 30.0) -> tuple[int, dict[str, Any]]:
    """Poll /health until ``pred(status, body)``; return that answer."""
    seen: list[tuple[int, dict[str, Any]]] = []

    def check() -> bool:
        seen.append(health(c))
        return pred(*seen[-1])

    wait_until(check, what, hang=hang)
    return seen[-1]


def test_a_stopped_replica_is_suspect_at_once_and_its_stage_503_when_no_other_makes_progress() -> None:
    # A long heartbeat timeout: the stopped workers are never declared dead here, only suspect.
    cfg = echo_config(1, replicas=2, heartbeat_interval=0.2, heartbeat_timeout=120.0, stop_grace=1.0)
    with supervised(cfg, RestartPolicy()) as (served, pipe):
        pids = [pipe.worker(0, r).pid for r in (0, 1)]
        stopped: list[int] = []
        try:
            with httpx.Client(base_url=served.url, timeout=HANG) as c:
                code, body = health(c)
                assert code == 200 and states(body, 0) == ["ready", "ready"]
                assert body["stages"][0]["suspect"] == 0

                os.kill(pids[0], signal.SIGSTOP)
                stopped.append(pids[0])
                code, body = poll_until(c, lambda _, b: states(b, 0)[0] == "suspect", "replica 0 suspect")
                # the other replica still makes progress: the stage serves, health stays 200
                assert code == 200 and body["status"] == "ok" and states(body, 0) == ["suspect", "ready"]
                rep = body["stages"][0]["replicas"][0]
                assert rep["silent_s"] > 0 and "no message for" in rep["reason"]
                assert body["stages"][0]["suspect"] == 1 and "suspect_stages" not in body
                assert c.post("/v1/chat/completions", json=chat("still served")).status_code == 200

                os.kill(pids[1], signal.SIGSTOP)
                stopped.append(pids[1])
                code, body = poll_until(c, lambda s, _: s == 503, "health 503 with every replica suspect")
                assert body["status"] == "degraded" and states(body, 0) == ["suspect", "suspect"]
                assert body["suspect_stages"] == [0] and body["unavailable_stages"] == []
                assert body["stages"][0]["live"] == 2  # routing still counts them: not dead, hung

                for pid in stopped:
                    os.kill(pid, signal.SIGCONT)
                stopped.clear()
                # 200 comes as soon as one of them heartbeats again: wait for both
                code, body = poll_until(c, lambda s, b: s == 200 and states(b, 0) == ["ready", "ready"],
                                        "health 200 and both ready once they heartbeat again")
                assert "suspect_stages" not in body
                assert c.post("/v1/chat/completions", json=chat("after")).status_code == 200
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    assert not any(worker_alive(pid) for pid in pids)


@pytest.mark.slow
def test_a_slot_the_supervisor_gave_up_is_reported_given_up_with_why_not_as_a_restart() -> None:
    cfg = echo_config(2, final_stage_ids=[1], heartbeat_interval=0.2, heartbeat_timeout=5.0,
                      stop_grace=1.0)
    policy = RestartPolicy(max_restarts=2, window=60.0, backoff_initial=0.01)
    fail = lambda k, r, attempt: ["--fail-at-startup", "bad weights"]  # noqa: E731
    with supervised(cfg, policy, fail) as (served, pipe):
        sup = pipe.supervisor
        victim = pipe.worker(1, 0).pid
        with httpx.Client(base_url=served.url, timeout=HANG) as c:
            os.kill(victim, signal.SIGKILL)
            samples: list[tuple[int, dict[str, Any], bool]] = []

            def given_up(code: int, body: dict[str, Any]) -> bool:
                samples.append((code, body, sup.counters().get("gave_up", 0) > 0))
                return body["stages"][1].get("given_up", False)

            code, body = poll_until(c, given_up, "stage 1 reported given up")
            assert code == 503 and body["status"] == "degraded" and body["unavailable_stages"] == [1]
            stage = body["stages"][1]
            assert stage["live"] == 0 and states(body, 1) == ["given_up"]
            rep = stage["replicas"][0]
            assert rep["given_up"] is True and rep["reason"] == stage["reason"]
            assert "2 restarts" in rep["reason"] and "exited" in rep["reason"]  # the cause of the death
            assert "bad weights" in rep["reason"]  # and why the last restart failed
            assert states(body, 0) == ["ready"] and "given_up" not in body["stages"][0]
            # while restarts were still being tried it read as restarting, never as given up
            before = [b for _, b, gave_up in samples if not gave_up]
            assert all(states(b, 1)[0] in ("ready", "restarting") for b in before)
            assert all(not b["stages"][1].get("given_up") for b in before)
            # and it stays so: no restart is in progress
            code, body = health(c)
            assert code == 503 and body["stages"][1]["given_up"] is True
