"""One model per stage: dummy weights seeded by what defines the model, never by position or replica.

So a seeded request answers the same whichever replica serves it, and the
halves of a split thinker are the unsplit one.
"""

from __future__ import annotations

import pytest
import trio

from stages.config import PipelineConfig, StageConfig, default_config, pd_config
from tests.workers.test_workers import TINY, checked_pipeline
from trio_orch import OrchOutput, open_orchestrator


def test_the_model_seed_follows_the_model_not_its_place() -> None:
    a = PipelineConfig([StageConfig("echo"), StageConfig("thinker", model={"layers": 1}, replicas=3)],
                       final_stage_ids=[1], seed=5)
    b = PipelineConfig([StageConfig("thinker", model={"layers": 1})], seed=5)
    assert a.model_seed(1) == b.model_seed(0)  # another position, other replica counts: the same model
    def thinker(layers: int, seed: int) -> int:
        return PipelineConfig([StageConfig("thinker", model={"layers": layers})], seed=seed).model_seed(0)

    assert thinker(1, 5) == b.model_seed(0) != thinker(2, 5)  # other options: another model
    assert thinker(1, 5) != thinker(1, 6)  # another pipeline seed
    pd, whole = pd_config(), default_config()
    assert pd.model_seed(0) == pd.model_seed(1) == whole.model_seed(0)  # prefill, decode, unsplit
    assert pd.model_seed(2) == whole.model_seed(1) and pd.model_seed(3) == whole.model_seed(2)
    assert 0 <= b.model_seed(0) < 2**31


@pytest.mark.processes
async def test_every_replica_answers_a_seeded_request_the_same() -> None:
    cfg = PipelineConfig([StageConfig("thinker", replicas=2, max_batch=2, model=dict(TINY["thinker"]))],
                         final_stage_ids=[0])
    sampling = [{"seed": 7, "temperature": 0.8}]
    async with checked_pipeline(cfg) as pipe, \
            open_orchestrator(pipe.stages, **pipe.orchestrator_kwargs()) as orch:
        for i in range(6):  # at once: two replicas of two slots each take them
            await orch.add_request(f"r{i}", "the same prompt", sampling=sampling)
        texts: dict[str, str] = {}
        done: set[str] = set()
        with trio.fail_after(60):
            while len(done) < 6:
                out = await orch.next_output()
                assert isinstance(out, OrchOutput), out
                texts[out.request_id] = texts.get(out.request_id, "") + str(out.data)
                if out.finished:
                    done.add(out.request_id)
        served = [s["submits"] for s in await pipe.stats()]
    assert all(n > 0 for n in served), served  # both replicas served some of them
    assert len(set(texts.values())) == 1, texts
