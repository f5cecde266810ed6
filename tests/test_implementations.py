"""The one registry of implementations: what it lists, what each supports, what it refuses."""

from __future__ import annotations

import pytest

from bench.drivers.base import Unsupported
from bench.implementations import CAPABILITIES, IMPLEMENTATIONS, make_driver, names
from bench.refs.omni import OmniEventDriven, OmniPolling
from bench.refs.taskgroup import TaskGroupOrchestrator
from trio_orch.config import echo_config
from trio_orch.testing import Misbehaviour


def test_every_job_finds_its_implementations_in_table_order() -> None:
    assert list(IMPLEMENTATIONS) == ["floor", "zmq-floor", "trio", "trio-engine", "omni-event", "omni-poll",
                                     "asyncio-taskgroup"]
    assert names("scripted") == ["trio", "omni-event", "omni-poll", "asyncio-taskgroup"]  # compare
    assert names("fed") == [n for n in IMPLEMENTATIONS if n != "zmq-floor"]  # bench, in-process
    assert names("in_loop") == ["floor", "trio", "omni-event", "omni-poll", "asyncio-taskgroup"]  # loop_*
    assert names("workers") == ["zmq-floor", "trio", "omni-event", "omni-poll", "asyncio-taskgroup"]
    assert names("pipeline") == ["trio"]  # chaos, the torch pipeline
    assert all(i.description and i.supports <= set(CAPABILITIES) for i in IMPLEMENTATIONS.values())
    with pytest.raises(ValueError, match="unknown capability"):
        names("teleport")


def test_the_asyncio_references_register_themselves_with_their_class() -> None:
    for name, cls in (("omni-event", OmniEventDriven), ("omni-poll", OmniPolling),
                      ("asyncio-taskgroup", TaskGroupOrchestrator)):
        driver = make_driver(name, 2, {1})
        assert driver.framework == "asyncio" and driver.name == name
        assert driver.orchestrator_cls is cls and driver.use_runner is cls.use_runner
        assert IMPLEMENTATIONS[name].description == cls.description


def test_a_driver_is_refused_what_its_implementation_does_not_support() -> None:
    with pytest.raises(ValueError, match="unknown implementation 'nope'"):
        make_driver("nope")
    with pytest.raises(ValueError, match="'floor' does not support scripted"):
        make_driver("floor", 2, {1}, misbehaviour={0: Misbehaviour(hang_abort=True)})
    with pytest.raises(ValueError, match="'omni-event' does not support pipeline"):
        make_driver("omni-event", workers=echo_config(2, replicas=2))
    floor = make_driver("floor", 2, {1})
    with pytest.raises(Unsupported, match="floor: add_request"):
        floor.add_request("r1", "p")
