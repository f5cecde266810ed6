"""Both engines satisfy the engine's seam, member by member, as httpcore checks its sync code against its
async code: the same names, the same kind of call, the same parameters.

:class:`~trio_orch.engine.api.EngineClient` is what the HTTP app, the command
line and the serve command call.  ``TrioEngine`` satisfies it in a Trio run,
the thread adapter ``ThreadEngine`` on an asyncio loop; the adapter adds the
blocking twin of each awaitable call under the name without ``_async``, and
derives whatever is no more than the engine's.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from trio_orch.engine import AsyncRequestHandle, EngineClient, ThreadEngine, TrioEngine, static_pipeline
from trio_orch.engine.api import AcceptedRequest, ReportsReady
from trio_orch.engine.derived import blocking, on_asyncio, passthrough
from trio_orch.testing import ScriptedStage

#: awaitable calls whose blocking twin the adapter writes itself (its own queue, its own parameters)
HAND_WRITTEN_TWINS = {"add_request_async": "add_request", "update_request_async": "update_request",
                      "stats_async": "stats"}


def declared(protocol: type) -> dict[str, Any]:
    """The members a Protocol declares: name -> the property or function in its body."""
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (isinstance(value, property) or inspect.isfunction(value))}


def shape(fn: Any) -> list[tuple[str, Any, Any]]:
    """A callable's parameters (bound: no ``self``) as names, kinds and defaults (annotations aside)."""
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return [(p.name, p.kind, p.default) for p in params]


def kind(fn: Any) -> str:
    return "awaitable" if inspect.iscoroutinefunction(fn) else "plain"


def engines() -> list[Any]:
    factory = static_pipeline([ScriptedStage(0)], {0})
    return [TrioEngine(factory), ThreadEngine(factory)]


def test_the_protocol_declares_what_a_front_calls() -> None:
    members = declared(EngineClient)
    assert {"running", "closed_reason", "shedding", "capacity", "retry_after", "paused", "final_stage_ids",
            "stage_params", "stage_kinds", "stage_info", "generate", "generate_batches", "add_request_async",
            "update_request_async", "abort", "abort_confirmed_async", "stats_async", "collective_rpc_async",
            "pause_async", "resume_async", "sleep_async", "wake_up_async", "update_weights_async",
            "start_profile_async", "stop_profile_async"} == set(members)
    # the one naming rule: an awaitable call ends in _async, and only one does
    for name, member in members.items():
        if inspect.isfunction(member):
            assert (kind(member) == "awaitable") == name.endswith("_async"), name


@pytest.mark.parametrize("engine", engines(), ids=["TrioEngine", "ThreadEngine"])
def test_each_engine_satisfies_the_protocol_member_by_member(engine: Any) -> None:
    assert isinstance(engine, EngineClient)
    for name, member in declared(EngineClient).items():
        got = getattr(engine, name)
        if isinstance(member, property):
            assert not callable(got), f"{name} is a property of the protocol, a callable here"
            continue
        assert kind(got) == kind(member), f"{type(engine).__name__}.{name}: {kind(got)}, not {kind(member)}"
        assert shape(got) == shape(member), f"{type(engine).__name__}.{name}: other parameters"


def test_the_adapter_has_the_blocking_twin_of_each_awaitable_call() -> None:
    engine = ThreadEngine(static_pipeline([ScriptedStage(0)], {0}))
    for name, member in declared(EngineClient).items():
        if not name.endswith("_async"):
            continue
        twin = getattr(engine, name.removesuffix("_async"))
        assert kind(twin) == "plain", name
        if name not in HAND_WRITTEN_TWINS:
            assert shape(twin) == shape(member), f"{name}: the blocking twin takes other parameters"
            assert twin.__doc__ == getattr(TrioEngine, name).__doc__


def test_what_the_adapter_only_passes_on_is_derived_not_written() -> None:
    """Its own properties are its own state; everything else of the engine's is a derived descriptor."""
    own = {name for name, value in vars(ThreadEngine).items() if isinstance(value, property)}
    assert own == {"running", "thread_alive", "failure"}
    derived = {name: value for name, value in vars(ThreadEngine).items()
               if isinstance(value, (passthrough, blocking, on_asyncio))}
    assert {"closed_reason", "shedding", "stage_info", "abort", "pause", "pause_async"} <= set(derived)
    for name in derived:
        assert hasattr(TrioEngine, name) or hasattr(TrioEngine, f"{name}_async"), name


def test_the_handle_satisfies_what_a_front_holds_of_an_accepted_request() -> None:
    for name in declared(AcceptedRequest):
        assert hasattr(AsyncRequestHandle, name), name
    assert set(AcceptedRequest.__annotations__) == {"rejection", "finished"}


def test_a_stage_reports_what_its_workers_said_when_ready_through_the_engine_only() -> None:
    """``stage_info`` is the one way a front reads a worker's handshake; an in-process stage says nothing."""
    class Reporting(ScriptedStage):
        def ready_info(self) -> dict[str, Any]:
            return {"max_new_tokens": 7}

    assert isinstance(Reporting(0), ReportsReady) and not isinstance(ScriptedStage(0), ReportsReady)
    with ThreadEngine(static_pipeline([Reporting(0), ScriptedStage(1)], {1})) as engine:
        assert engine.stage_info(0) == {"max_new_tokens": 7}
        assert engine.stage_info(1) == {}
        assert engine.stage_kinds is None  # an in-process pipeline declares no kinds
