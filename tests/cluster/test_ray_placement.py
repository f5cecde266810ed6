"""The Ray placement plan and its checks against a cluster's nodes (pure: no Ray, no process).

What a pipeline config asks of a Ray cluster (bundles per replica, grouped by
``placement_scope`` with ``placement_strategy``), and whether given nodes can
ever hold it -- with a message naming the replica and the resource when they
cannot.  The same checks run at start against ``ray.nodes()``
(``tests/cluster/test_ray_cluster.py`` shows it on a real cluster).
"""

from __future__ import annotations

import pytest

from stages.config import PipelineConfig, StageConfig, default_config, from_dict
from stages.placement import VISIBLE
from trio_orch.cluster.ray_backend import CONFIG_ENV, worker_launch
from trio_orch.cluster.ray_placement import Bundle, Group, Node, matches, plan, unfit, unplaced

HEAD = Node("a" * 56, "10.0.0.1", {"CPU": 8.0, "head": 10.0, "memory": 1e10}, {"node": "head"})
GPU = Node("b" * 56, "10.0.0.2", {"CPU": 4.0, "GPU": 1.0}, {"node": "gpu", "zone": "z1"})


def speech(**pipeline: object) -> PipelineConfig:
    return default_config(**pipeline)  # type: ignore[arg-type]


def test_one_bundle_per_replica_in_stage_order_cpu_1_by_default() -> None:
    cfg = speech()
    cfg.stages[0].resources = {"num_gpus": 1}
    cfg.stages[1].replicas = 2
    cfg.stages[1].label_selector = {"node": "gpu"}
    cfg.stages[2].resources = {"num_cpus": 0.5, "head": 0.01}
    [g] = plan(cfg)
    assert (g.name, g.strategy) == ("pipeline", "PACK")
    assert [(b.stage_id, b.replica, dict(b.resources), dict(b.label_selector)) for b in g.bundles] == [
        (0, 0, {"CPU": 1.0, "GPU": 1.0}, {}),
        (1, 0, {"CPU": 1.0}, {"node": "gpu"}),
        (1, 1, {"CPU": 1.0}, {"node": "gpu"}),
        (2, 0, {"CPU": 0.5, "head": 0.01}, {}),
    ]
    assert g.bundles[0].actor_options() == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert g.bundles[3].actor_options() == {"num_cpus": 0.5, "num_gpus": 0, "resources": {"head": 0.01}}


def test_a_replica_on_cuda_reserves_a_gpu_and_is_told_cuda_0_as_ray_shows_it_its_gpu() -> None:
    cfg = from_dict({"pipeline": {"final_stages": [2], "device": "cuda"},
                     "stages": [{"kind": "echo", "device": "cuda:1"},
                                {"kind": "echo", "replicas": 2, "device": ["cpu", "cuda:0"]},
                                {"kind": "echo", "resources": {"num_gpus": 0.5}}]})  # the pipeline's cuda
    [g] = plan(cfg)
    assert [(b.name, dict(b.resources)) for b in g.bundles] == [
        ("stage 0 (echo) replica 0", {"CPU": 1.0, "GPU": 1.0}),
        ("stage 1 (echo) replica 0", {"CPU": 1.0}),
        ("stage 1 (echo) replica 1", {"CPU": 1.0, "GPU": 1.0}),
        ("stage 2 (echo) replica 0", {"CPU": 1.0, "GPU": 0.5}),  # a fraction of one: shared with others
    ]
    assert [b.actor_options()["num_gpus"] for b in g.bundles] == [1.0, 0, 1.0, 0.5]
    launched = [worker_launch(b, "tcp://10.0.0.1:7000", f"m{i}", "{}") for i, b in enumerate(g.bundles)]
    devices = [argv[argv.index("--device") + 1] for argv, _ in launched]
    assert devices == ["cuda:0", "cpu", "cuda:0", "cuda:0"]
    # a GPU actor's worker keeps the CUDA_VISIBLE_DEVICES Ray gives the actor; a CPU one's sees no GPU
    assert [env.get(VISIBLE) for _, env in launched] == [None, "", None, None]
    argv, env = launched[0]
    assert argv[argv.index("--stage") + 1] == "0" and argv[argv.index("--member-id") + 1] == "m0"
    assert env[CONFIG_ENV] == "{}"


def test_gpus_the_cluster_lacks_are_refused_naming_the_replica() -> None:
    cfg = from_dict({"pipeline": {"final_stages": [1]},
                     "stages": [{"kind": "echo", "device": "cuda:1"}, {"kind": "echo", "device": "cpu"}]})
    assert unfit(plan(cfg), [HEAD]) == ("missing resource 'GPU': stage 0 (echo) replica 0 needs GPU 1 on one "
                                        "node, and no node has more than 0")
    assert unfit(plan(cfg), [HEAD, GPU]) is None
    two = from_dict({"pipeline": {"final_stages": [0]},
                     "stages": [{"kind": "echo", "replicas": 2, "device": "cuda"}]})
    assert unfit(plan(two), [HEAD, GPU]) == ("missing resource 'GPU': the pipeline's replicas need GPU 2 in "
                                             "all, the cluster has 1 (2 nodes)")


def test_a_cuda_replica_whose_resources_give_it_no_gpu_is_a_config_error() -> None:
    cfg = from_dict({"stages": [{"kind": "echo", "replicas": 2, "device": ["cpu", "cuda:0"],
                                 "resources": {"num_gpus": 0}}]})
    with pytest.raises(ValueError, match=r"stage 0 \(echo\) replica 1 resources: device cuda:0 needs a GPU, "
                                         r"but num_gpus is 0"):
        plan(cfg)


def test_scope_stage_makes_a_group_per_stage_with_the_strategy() -> None:
    cfg = speech(placement_scope="stage", placement_strategy="STRICT_SPREAD")
    cfg.stages[1].replicas = 0  # a stage with no replica has no group
    groups = plan(cfg)
    assert [(g.name, g.strategy, len(g.bundles)) for g in groups] == [
        ("stage 0 (thinker)", "STRICT_SPREAD", 1), ("stage 2 (code2wav)", "STRICT_SPREAD", 1)]


def test_a_replica_that_reserves_nothing_is_a_config_error() -> None:
    cfg = speech()
    cfg.stages[1].resources = {"num_cpus": 0}
    with pytest.raises(ValueError, match=r"stage 1 \(talker\) resources: a replica must reserve some"):
        plan(cfg)


def test_the_config_file_takes_placement_keys_and_refuses_unknown_strategies() -> None:
    data = {"pipeline": {"placement_strategy": "SPREAD", "placement_scope": "stage"},
            "stages": [{"kind": "echo", "label_selector": {"zone": "in(z1,z2)"},
                        "resources": {"gpu_node": 1}}]}
    cfg = from_dict(data)
    assert (cfg.placement_strategy, cfg.placement_scope) == ("SPREAD", "stage")
    assert cfg.stages[0].label_selector == {"zone": "in(z1,z2)"}
    with pytest.raises(ValueError, match="placement_strategy"):
        from_dict({**data, "pipeline": {"placement_strategy": "PACKED"}})
    with pytest.raises(ValueError, match="placement_scope"):
        from_dict({**data, "pipeline": {"placement_scope": "node"}})


@pytest.mark.parametrize(("selector", "labels", "ok"), [
    ({"node": "gpu"}, {"node": "gpu"}, True),
    ({"node": "gpu"}, {"node": "head"}, False),
    ({"node": "gpu"}, {}, False),
    ({"node": "!gpu"}, {"node": "head"}, True),
    ({"node": "!gpu"}, {}, True),
    ({"zone": "in(z1, z2)"}, {"zone": "z2"}, True),
    ({"zone": "!in(z1,z2)"}, {"zone": "z2"}, False),
    ({"node": "gpu", "zone": "z1"}, {"node": "gpu", "zone": "z1"}, True),
])
def test_label_selectors_match_as_rays(selector: dict[str, str], labels: dict[str, str], ok: bool) -> None:
    assert matches(selector, labels) is ok


def test_a_pipeline_the_nodes_hold_is_fine() -> None:
    cfg = speech()
    cfg.stages[0].resources = {"num_gpus": 1}
    cfg.stages[1].label_selector = {"node": "head"}
    assert unfit(plan(cfg), [HEAD, GPU]) is None


def test_more_gpus_than_any_node_names_the_replica_and_the_resource() -> None:
    cfg = speech()
    cfg.stages[0].resources = {"num_gpus": 2}
    why = unfit(plan(cfg), [HEAD, GPU])
    assert why == ("missing resource 'GPU': stage 0 (thinker) replica 0 needs GPU 2 on one node, and no node "
                   "has more than 1")


def test_a_label_no_node_has_is_named_with_the_labels_the_nodes_have() -> None:
    cfg = speech()
    cfg.stages[1].label_selector = {"node": "tpu"}
    why = unfit(plan(cfg), [HEAD, GPU])
    assert why is not None and why.startswith("stage 1 (talker) replica 0 needs a node with labels "
                                              "{'node': 'tpu'}: none has them")
    assert "10.0.0.2" in why and "'zone': 'z1'" in why


def test_a_custom_resource_only_other_nodes_have_with_the_label_is_missing_there() -> None:
    cfg = speech()
    cfg.stages[1].label_selector = {"node": "gpu"}
    cfg.stages[1].resources = {"head": 1}  # only the head node has it
    why = unfit(plan(cfg), [HEAD, GPU])
    assert why == ("missing resource 'head': stage 1 (talker) replica 0 needs head 1 on one node, and no "
                   "node with its labels has more than 0")


def test_each_replica_fits_but_not_all_of_them_together() -> None:
    cfg = speech()
    cfg.stages[0].replicas = 2
    cfg.stages[0].resources = {"num_gpus": 1}
    why = unfit(plan(cfg), [HEAD, GPU])
    assert why == ("missing resource 'GPU': the pipeline's replicas need GPU 2 in all, the cluster has 1 "
                   "(2 nodes)")


def test_strict_strategies_need_one_node_or_one_node_each() -> None:
    cfg = speech(placement_strategy="STRICT_SPREAD")
    cfg.stages[1].replicas = 2  # 4 replicas, 2 nodes
    why = unfit(plan(cfg), [HEAD, GPU])
    assert why is not None and why.startswith("placement group pipeline is STRICT_SPREAD: each of its 4 "
                                              "replicas needs a node of its own")
    cfg = speech(placement_strategy="STRICT_SPREAD")
    cfg.stages[2].replicas = 0
    assert unfit(plan(cfg), [HEAD, GPU]) is None  # 2 replicas, 2 nodes
    cfg.stages[0].label_selector = {"node": "gpu"}
    cfg.stages[1].label_selector = {"node": "gpu"}  # both want the one GPU node
    assert unfit(plan(cfg), [HEAD, GPU]) is not None
    packed = speech(placement_strategy="STRICT_PACK")
    for st in packed.stages:
        st.resources = {"num_cpus": 3}
    why = unfit(plan(packed), [HEAD, GPU])
    assert why == "placement group pipeline is STRICT_PACK: one node must hold CPU 9, and none can"
    assert unfit(plan(speech(placement_strategy="STRICT_PACK")), [HEAD, GPU]) is None


def test_no_alive_node() -> None:
    assert unfit(plan(speech()), []) == "the Ray cluster has no alive node"


def test_not_placed_in_time_says_what_is_short_or_that_it_does_not_pack() -> None:
    b = Bundle(1, 0, "talker", {"CPU": 1.5})
    group = Group("pipeline", "PACK", (b, b))
    short = unplaced([group], [False], {"CPU": 2.0}, 5.0)
    assert short == ("the Ray cluster did not place placement group(s) pipeline within 5 s "
                     "(startup_timeout): the cluster is short of CPU (need 3, 2 free) (its nodes have "
                     "enough in all: other work holds the rest)")
    packs = unplaced([group], [False], {"CPU": 4.0}, 5.0)
    assert packs.endswith("the cluster has CPU 3 free in all, but no way to give each replica one node that "
                          "holds all it needs, with its labels, under the strategy")


def test_stage_configs_keep_their_placement_through_the_dict_a_remote_worker_gets() -> None:
    from stages.config import to_dict

    cfg = PipelineConfig([StageConfig("echo", label_selector={"node": "two"}, resources={"node2": 1.0})],
                         placement_strategy="SPREAD").validate()
    back = from_dict(to_dict(cfg))
    assert back.stages[0].label_selector == {"node": "two"} and back.placement_strategy == "SPREAD"
