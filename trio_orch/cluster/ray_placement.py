"""Where ``--worker-backend ray`` puts the replicas: placement groups from the pipeline config.

Each replica is one *bundle* -- what its actor reserves on a node: the
stage's ``resources`` (``num_cpus``, default 1; ``num_gpus``; any custom
resource, e.g. one only the GPU nodes have) and its ``label_selector`` (Ray
node labels its node must carry).  A replica whose device (its own, its
stage's or the pipeline's: :meth:`~stages.config.PipelineConfig.replica_device`)
is CUDA reserves a GPU too -- ``num_gpus`` when the stage says it (a fraction
shares one), else 1 -- and its worker is told ``cuda:0``: Ray picks the GPU
on the node and sets the actor's ``CUDA_VISIBLE_DEVICES`` to it, which the
worker inherits, so it sees that GPU alone (the ``N`` of ``cuda:N`` does not
choose a GPU of a Ray node: Ray does).  A CPU replica's worker is started with
``CUDA_VISIBLE_DEVICES`` empty: Ray leaves the variable as the node had it
for an actor that reserves no GPU, and the worker must not see the node's
GPUs (:meth:`Bundle.worker_device`).  The bundles go into placement groups by
``[pipeline] placement_scope``: one group for the whole pipeline
(``"pipeline"``, the default) or one per stage (``"stage"``), each with
``[pipeline] placement_strategy`` (Ray's ``PACK``, ``SPREAD``,
``STRICT_PACK``, ``STRICT_SPREAD``).  A replica's actor runs in its bundle,
and so does every replacement of it: Ray re-places a bundle whose node was
lost on a node left that fits it, or keeps it pending until one does.

Before it asks Ray for anything, :func:`unfit` checks the plan against the
nodes of the cluster (their total resources and labels) and names what is
missing -- a replica no node can hold, a resource the whole cluster has too
little of, a strict strategy the nodes cannot honour -- so a pipeline the
cluster can never hold is an error at start naming the resource, not a wait.
A plan that fits the totals but not what is free now gets the startup
timeout to be placed, then an error naming what the cluster has free.

This module is pure apart from :func:`cluster_nodes` (reads ``ray.nodes()``):
the plan and the checks are unit-tested without Ray.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stages.config import PipelineConfig
from stages.placement import VISIBLE, cuda_index

__all__ = ["STRATEGIES", "Bundle", "Group", "Node", "PlacementError", "cluster_nodes", "matches", "plan",
           "short", "unfit", "unplaced"]

#: Ray's placement strategies
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

#: config names of Ray's built-in resources (the rest are custom resources, named as they are)
_BUILTIN = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}


class PlacementError(RuntimeError):
    """The cluster cannot hold the pipeline's replicas (the message names what is missing)."""


@dataclass(frozen=True)
class Bundle:
    """One replica's reservation: Ray resource names -> amounts, and node labels its node must have."""

    stage_id: int
    replica: int
    stage_label: str
    resources: Mapping[str, float]
    label_selector: Mapping[str, str] = field(default_factory=dict)
    #: the device the config asks for this replica (cpu, cuda, cuda:N)
    device: str = "cpu"

    @property
    def name(self) -> str:
        return f"stage {self.stage_id} ({self.stage_label}) replica {self.replica}"

    def worker_device(self) -> tuple[str, dict[str, str]]:
        """What this replica's worker is told (``--device``) and the variables it is started with.

        On CUDA: ``cuda:0`` and nothing set -- Ray sets ``CUDA_VISIBLE_DEVICES``
        of an actor that reserves GPUs to the GPU(s) of its bundle, and the
        worker inherits the actor's environment.  On the CPU: ``cpu`` and
        ``CUDA_VISIBLE_DEVICES`` empty -- Ray leaves an actor without GPUs
        the node's variable, which would let the worker see every GPU.
        """
        if cuda_index(self.device) is None:
            return "cpu", {VISIBLE: ""}
        return "cuda:0", {}

    def actor_options(self) -> dict[str, Any]:
        """``ray.remote`` options of an actor that takes this whole bundle."""
        res = dict(self.resources)
        opts: dict[str, Any] = {"num_cpus": res.pop("CPU", 0), "num_gpus": res.pop("GPU", 0)}
        if "memory" in res:
            opts["memory"] = res.pop("memory")
        if res:
            opts["resources"] = res
        return opts


@dataclass(frozen=True)
class Group:
    """One placement group: its strategy and bundles (in bundle-index order)."""

    name: str
    strategy: str
    bundles: tuple[Bundle, ...]


@dataclass(frozen=True)
class Node:
    """An alive node of the cluster: its total resources and labels."""

    node_id: str
    address: str
    resources: Mapping[str, float]
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"


def _bundle_resources(resources: Mapping[str, float], where: str, device: str = "cpu") -> dict[str, float]:
    out: dict[str, float] = {"CPU": 1.0}
    if cuda_index(device) is not None:
        out["GPU"] = 1.0  # a CUDA replica reserves its GPU (the stage's num_gpus, if given, says how much)
    for key, amount in resources.items():
        out[_BUILTIN.get(key, key)] = float(amount)
    if cuda_index(device) is not None and out["GPU"] <= 0:
        raise ValueError(f"{where}: device {device} needs a GPU, but num_gpus is {out['GPU']:g}: Ray would "
                         "give its actor none (leave num_gpus out for one GPU, or give a fraction to share "
                         "one)")
    out = {k: v for k, v in out.items() if v > 0}
    if not out:
        raise ValueError(f"{where}: a replica must reserve some resource on its node (num_cpus is 0 and "
                         "nothing else is asked for): give num_cpus > 0, num_gpus or a custom resource")
    return out


def plan(cfg: PipelineConfig) -> list[Group]:
    """The placement groups of ``cfg``'s replicas (ValueError naming a stage that reserves nothing, or a
    CUDA replica whose resources give it no GPU)."""
    if cfg.placement_strategy not in STRATEGIES:
        raise ValueError(f"placement_strategy {cfg.placement_strategy!r}: one of {', '.join(STRATEGIES)}")
    per_stage: list[list[Bundle]] = []
    for k, st in enumerate(cfg.stages):
        bundles = []
        for r in range(st.replicas):
            device = cfg.replica_device(k, r)
            where = f"stage {k} ({st.label}) replica {r}" if isinstance(st.device, list) else \
                f"stage {k} ({st.label})"
            res = _bundle_resources(st.resources, f"{where} resources", device)
            bundles.append(Bundle(k, r, st.label, res, dict(st.label_selector), device))
        per_stage.append(bundles)
    if cfg.placement_scope == "stage":
        return [Group(f"stage {k} ({cfg.stages[k].label})", cfg.placement_strategy, tuple(b))
                for k, b in enumerate(per_stage) if b]
    if cfg.placement_scope != "pipeline":
        raise ValueError(f"placement_scope {cfg.placement_scope!r}: 'pipeline' or 'stage'")
    every = tuple(b for bundles in per_stage for b in bundles)
    return [Group("pipeline", cfg.placement_strategy, every)] if every else []


def cluster_nodes(raw: Iterable[Mapping[str, Any]]) -> list[Node]:
    """The alive nodes of ``ray.nodes()``'s answer."""
    return [Node(str(n.get("NodeID", "")), str(n.get("NodeManagerAddress", "?")),
                 dict(n.get("Resources") or {}), dict(n.get("Labels") or {}))
            for n in raw if n.get("Alive")]


_IN = re.compile(r"^(!?)in\((.*)\)$")


def matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Does a node with ``labels`` satisfy Ray's label ``selector``?

    Ray's forms: ``v``, ``!v``, ``in(a,b)``, ``!in(a,b)``.
    """
    for key, want in selector.items():
        have = labels.get(key)
        m = _IN.match(want)
        if m:
            allowed = {v.strip() for v in m.group(2).split(",")}
            ok = have in allowed
            if m.group(1):
                ok = not ok
        elif want.startswith("!"):
            ok = have != want[1:]
        else:
            ok = have == want
        if not ok:
            return False
    return True


def short(resources: Mapping[str, float]) -> str:
    """``{'CPU': 1.0, 'GPU': 2.0}`` as ``CPU 1, GPU 2`` (messages)."""
    return ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items())) or "nothing"


def _fits(bundle: Bundle, capacity: Mapping[str, float]) -> bool:
    return all(capacity.get(k, 0.0) >= v - 1e-9 for k, v in bundle.resources.items())


def _single(bundle: Bundle, nodes: Sequence[Node]) -> str | None:
    """Why no node can ever hold ``bundle`` alone, or None."""
    labelled = [n for n in nodes if matches(bundle.label_selector, n.labels)]
    if not labelled:
        have = "; ".join(f"{n.name}: {dict(n.labels) or 'no labels'}" for n in nodes) or "no alive node"
        return (f"{bundle.name} needs a node with labels {dict(bundle.label_selector)}: none has them "
                f"({have})")
    if any(_fits(bundle, n.resources) for n in labelled):
        return None
    for key, amount in sorted(bundle.resources.items()):
        most = max((n.resources.get(key, 0.0) for n in labelled), default=0.0)
        if most < amount - 1e-9:
            where = " with its labels" if bundle.label_selector else ""
            return (f"missing resource {key!r}: {bundle.name} needs {key} {amount:g} on one node, and no "
                    f"node{where} has more than {most:g}")
    return f"{bundle.name} needs {short(bundle.resources)} on one node: no node has all of it"


def _spread(bundles: Sequence[Bundle], nodes: Sequence[Node]) -> bool:
    """Can every bundle have a node of its own (bipartite matching, augmenting paths)?"""
    owner: dict[int, int] = {}

    def place(b: int, seen: set[int]) -> bool:
        for j, n in enumerate(nodes):
            fits = matches(bundles[b].label_selector, n.labels) and _fits(bundles[b], n.resources)
            if j in seen or not fits:
                continue
            seen.add(j)
            if j not in owner or place(owner[j], seen):
                owner[j] = b
                return True
        return False

    return all(place(b, set()) for b in range(len(bundles)))


def unfit(groups: Sequence[Group], nodes: Sequence[Node]) -> str | None:
    """Why the cluster's nodes can never hold ``groups`` (naming the replica and resource), or None.

    Checked against the nodes' *total* resources: each bundle alone, each
    resource summed over every group, and the strict strategies (one node
    for a ``STRICT_PACK`` group; a node of its own per bundle of a
    ``STRICT_SPREAD`` group).  What is in use now is not counted: that only
    delays the placement (see :func:`unplaced`).
    """
    if not nodes:
        return "the Ray cluster has no alive node"
    for g in groups:
        for b in g.bundles:
            why = _single(b, nodes)
            if why is not None:
                return why
    need: dict[str, float] = {}
    for g in groups:
        for b in g.bundles:
            for k, v in b.resources.items():
                need[k] = need.get(k, 0.0) + v
    for key, amount in sorted(need.items()):
        total = sum(n.resources.get(key, 0.0) for n in nodes)
        if total < amount - 1e-9:
            return (f"missing resource {key!r}: the pipeline's replicas need {key} {amount:g} in all, the "
                    f"cluster has {total:g} ({len(nodes)} node{'s' if len(nodes) != 1 else ''})")
    for g in groups:
        if g.strategy == "STRICT_PACK" and len(g.bundles) > 1:
            summed: dict[str, float] = {}
            for b in g.bundles:
                for k, v in b.resources.items():
                    summed[k] = summed.get(k, 0.0) + v
            labels = {k: v for b in g.bundles for k, v in b.label_selector.items()}
            one = Bundle(-1, -1, g.name, summed, labels)
            if not any(_fits(one, n.resources) and matches(one.label_selector, n.labels) for n in nodes):
                return (f"placement group {g.name} is STRICT_PACK: one node must hold {short(summed)}, and "
                        "none can")
        if g.strategy == "STRICT_SPREAD" and not _spread(g.bundles, nodes):
            return (f"placement group {g.name} is STRICT_SPREAD: each of its {len(g.bundles)} replicas "
                    f"needs a node of its own that fits it, and the cluster has {len(nodes)} node"
                    f"{'s' if len(nodes) != 1 else ''} (not enough that fit)")
    return None


def unplaced(groups: Sequence[Group], ready: Sequence[bool], available: Mapping[str, float],
             timeout: float) -> str:
    """The error for groups still not placed after ``timeout`` seconds: what they need, what is free."""
    waiting = [g for g, ok in zip(groups, ready, strict=True) if not ok]
    need: dict[str, float] = {}
    for g in waiting:
        for b in g.bundles:
            for k, v in b.resources.items():
                need[k] = need.get(k, 0.0) + v
    short_of = [f"{k} (need {v:g}, {available.get(k, 0.0):g} free)" for k, v in sorted(need.items())
                if available.get(k, 0.0) < v - 1e-9]
    names = ", ".join(g.name for g in waiting)
    tail = (f"the cluster is short of {', '.join(short_of)} (its nodes have enough in all: other work "
            "holds the rest)" if short_of else
            f"the cluster has {short(need)} free in all, but no way to give each replica one node that "
            "holds all it needs, with its labels, under the strategy")
    return (f"the Ray cluster did not place placement group(s) {names} within {timeout:g} s "
            f"(startup_timeout): {tail}")
