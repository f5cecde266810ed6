"""Chaos rows that kill or lose a replica holding queued requests: those are failed over, not failed.

Echo workers, 2 replicas per stage, the killed stage batching a few requests
at a time so that most of what its replica holds waits inside it, having
produced nothing.  Each row must resend those (``retried``) and end no
request ``replica_died`` that had produced nothing where its replica died
(``silent_deaths``), besides the guarantees every chaos row keeps.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.chaos.faults import FAULTS
from bench.chaos.run import ChaosOptions, ChaosResult, ChaosRun
from trio_orch.types import OrchError

pytestmark = pytest.mark.processes

OPTS = ChaosOptions(requests=150, concurrency=32, echo=True, request_timeout=20.0, probe_requests=10,
                    progress=False)


def check_failover(res: ChaosResult) -> None:
    assert res.error is None, res.error
    assert res.without_terminal == 0 and res.duplicates == 0 and res.after_terminal == 0
    assert (res.leaked_processes, res.leaked_fds, res.leaked_ipc_files) == (0, 0, 0)
    assert res.still_serving == "yes" and set(res.failed) <= {"replica_died"}
    assert res.notes["retried"] > 0, res.notes  # the dead replica's queued requests were resent
    assert res.silent_deaths == 0  # none of those ended replica_died
    assert res.ok


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kill9", "sigstop", "remote_lost"])
async def test_a_lost_replica_s_queued_requests_are_failed_over(name: str) -> None:
    check_failover(await FAULTS[name].run(OPTS))


class _ObservedStage:
    """A stage client that declares it reports timings (:class:`ObservedStageClient`): only ``timing_of``
    is read here."""

    queue_seconds = compute_seconds = transfer_seconds = None
    input_bytes = 0

    def __init__(self, t_first: float | None) -> None:
        self.timing = SimpleNamespace(t_first=t_first)

    async def submit(self, request_id: str, payload: object) -> None: ...
    async def abort(self, request_ids: list[str]) -> None: ...
    async def receive(self) -> list: ...
    async def aclose(self) -> None: ...
    def replica_states(self) -> list: ...
    def in_flight(self) -> list: ...

    def timing_of(self, request_id: str) -> SimpleNamespace:
        return self.timing


class _Run:
    """What ``ChaosRun.died_silent`` reads: the core's mode and the pools' timings."""

    def __init__(self, async_chunk: bool, t_first: float | None) -> None:
        self.orch = SimpleNamespace(router=SimpleNamespace(async_chunk=async_chunk))
        self.pipe = SimpleNamespace(stages=[_ObservedStage(t_first)])


@pytest.mark.parametrize(("async_chunk", "t_first", "partial", "silent"), [
    (False, None, {}, True),  # nothing from the stage whose replica died: failover should have resent it
    (False, 1.0, {}, False),  # it had produced output there: replica_died is the rule
    (True, None, {}, True),  # async-chunk, nothing shown: a restart should have happened
    (True, None, {0: ["tok"]}, False),  # async-chunk, something shown: replica_died is the rule
])
def test_a_silent_death_is_one_failover_should_have_prevented(async_chunk: bool, t_first: float | None,
                                                             partial: dict, silent: bool) -> None:
    err = OrchError("r", 0, "replica_died", "stage0: replica 0 died")
    err.partial = partial
    assert ChaosRun.died_silent(_Run(async_chunk, t_first), err) is silent  # type: ignore[arg-type]
    other = OrchError("r", 0, "timeout", "deadline")
    assert ChaosRun.died_silent(_Run(async_chunk, t_first), other) is False  # type: ignore[arg-type]
