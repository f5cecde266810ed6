"""Pipeline configuration: which stages, their model kind and sizes, replicas, device.

A pipeline is a TOML file (``trio-orch generate --config FILE``)::

    [pipeline]
    final_stages = [0, 2]     # stages whose outputs reach the user
    async_chunk = false       # stream chunks worker-to-worker
    device = "cpu"            # or "cuda", "cuda:N": every stage's, unless it says its own
    seed = 0

    [[stages]]
    kind = "thinker"          # a built-in kind (stages.registry.KINDS), or "package.module:Class"
    replicas = 1
    max_batch = 32            # most requests in one batched step of a worker
    max_inflight = 32         # admission bound per replica (0: none; default max_batch when serving)
    device = "cuda:1"         # this stage's device, or one per replica: ["cuda:0", "cuda:1"]
    [stages.model]            # model options: the model constructor's keyword arguments
    max_new_tokens = 48

    [[stages]]
    kind = "talker"
    ...

A kind that can be split runs over two stages with ``role = "prefill"`` and
``role = "decode"`` (prefill/decode disaggregation: the thinker's KV cache
goes from the prefill replica to the decode replica chosen for the request);
the two stages are adjacent, have the same kind and model options, and may
have different replica counts.

:data:`PIPELINES` are the built-in pipelines by name (``--pipeline``):
``speech`` (:func:`default_config`, thinker -> talker -> code2wav),
``speech-pd`` (the same with the thinker split into prefill and decode),
``text2image`` (:func:`text2image_config`, encoder -> diffusion) and
``omni-in`` (:func:`omni_in_config`, image-encoder -> audio-encoder -> thinker:
images and sounds in, text out);
:func:`echo_config` builds torch-free echo pipelines (benchmarks, fault tests).
Each setting is declared once, with its type, its range and its default, as
a field of :class:`StageConfig` or :class:`PipelineConfig` (``msgspec``
Structs); the file's layout is made of them -- ``[[stages]]`` tables are
:class:`StageConfig`, the ``[pipeline]`` table (:data:`PipelineTable`) is
generated from :class:`PipelineConfig`'s fields -- so a wrong type, a value
out of range, an unknown key or a misspelt table is a ``ValueError`` naming
the key's path, and a key left out takes the field's default.  Kinds are the
rows of :mod:`stages.registry`; :meth:`PipelineConfig.validate` checks each
stage's kind and model options there (names, and types against the model
constructor's annotations), so a typo is a ``ValueError`` before any worker
starts.  A plug-in kind (an import path) is imported to be
checked; built-in kinds are checked without importing torch.  Where each
replica runs -- its device, the one GPU its process sees -- is
:mod:`stages.placement`'s.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType, field
from msgspec.structs import replace

from stages.fit import check_fit
from stages.media import FEATURE_DIM
from stages.placement import Placement, place
from stages.registry import KindError, check_stage, outputs_of, stage_sizes
from stages.schema import (
    ConfigError,
    Device,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    PositiveSeconds,
    Seconds,
    explain,
)
from stages.validation import Invalid, convert

__all__ = ["PIPELINES", "ConfigFile", "PipelineConfig", "PipelineTable", "StageConfig", "builtin_config",
           "check_file", "checkpoint_config", "default_config", "echo_config", "from_dict", "load_config",
           "omni_in_config", "pd_config", "text2image_config", "to_dict"]

class StageConfig(Struct, forbid_unknown_fields=True):
    """One stage (one ``[[stages]]`` table): ``kind``, ``replicas`` worker processes, model options.

    ``worker_args`` are extra ``python -m stages.worker`` flags (fault
    injection: ``["--crash-after-steps", "3"]``); ``replica_args`` maps a
    replica index to flags for that replica only.  ``max_inflight`` bounds,
    per live replica, the admitted requests that still have to pass this
    stage (0: no bound; None: ``max_batch`` when serving, none otherwise):
    more would only queue inside the worker.  ``role``: ``"prefill"`` or
    ``"decode"`` for the two stages of a split kind, else empty.  ``device``:
    this stage's device, or a list with one per replica (None: the pipeline's;
    see :mod:`stages.placement`).
    """

    kind: Annotated[str, Meta(min_length=1)]
    replicas: NonNegativeInt = 1
    model: dict[str, Any] = field(default_factory=dict)
    max_batch: PositiveInt = 32
    max_inflight: NonNegativeInt | None = None
    threads: PositiveInt = 1
    worker_args: list[str] = field(default_factory=list)
    replica_args: dict[int, list[str]] = field(default_factory=dict)
    name: str = ""
    role: str = ""  # which roles a kind has: the registry says (naming them)
    #: what one replica needs from a Ray cluster (``--worker-backend ray``): its placement-group
    #: bundle, e.g. ``{num_gpus = 1}`` or a custom resource of the nodes it may run on; ``num_cpus``
    #: defaults to 1
    resources: dict[str, NonNegativeFloat] = field(default_factory=dict)
    #: Ray node labels a replica's node must have (``--worker-backend ray``; Ray's label selector:
    #: ``{zone = "gpu"}``, ``"!spot"``, ``"in(a,b)"``)
    label_selector: dict[str, str] = field(default_factory=dict)
    #: this stage's device, or one per replica (None, or left out: the pipeline's)
    device: Device | Annotated[list[Device], Meta(min_length=1)] | None = None

    @property
    def label(self) -> str:
        return self.name or (f"{self.kind} {self.role}" if self.role else self.kind)


class PipelineConfig(Struct):
    """A whole pipeline.  ``heartbeat_timeout``: silence after which a replica is dead;
    ``startup_timeout``: most seconds a worker may take to become ready;
    ``stop_grace``: seconds between SIGTERM and SIGKILL when stopping workers;
    ``max_retries``: failovers per request when the replica holding it dies before
    answering it (0: off; see docs/fault-tolerance.md).  ``placement_strategy`` and
    ``placement_scope``: how ``--worker-backend ray`` groups the replicas' bundles (Ray's
    strategies; one placement group for the pipeline or one per stage; see docs/distributed.md)."""

    stages: Annotated[list[StageConfig], Meta(min_length=1)]
    #: the stages whose outputs reach the user (the file's ``final_stages``)
    final_stage_ids: Annotated[list[NonNegativeInt], Meta(min_length=1)] = field(default_factory=lambda: [0])
    async_chunk: bool = False
    device: Device = "cpu"
    seed: int = 0
    heartbeat_interval: Seconds = 0.5
    heartbeat_timeout: PositiveSeconds = 5.0
    startup_timeout: PositiveSeconds = 60.0
    stop_grace: Seconds = 3.0
    max_retries: NonNegativeInt = 1
    #: --worker-backend ray: Ray's placement strategy for the replicas' bundles, and whether one
    #: placement group holds the whole pipeline or each stage gets its own
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    placement_scope: Literal["pipeline", "stage"] = "pipeline"

    def validate(self) -> PipelineConfig:
        """Raise ValueError naming the stage (or the key's path) and the problem; return self.

        Types and ranges come from the schema (:mod:`stages.schema`); what is
        checked here is what spans keys: kinds and their options, the final
        stages, heartbeats, split roles.  Imports plug-in models (to check
        their class); never starts a worker.
        """
        check_file(to_dict(self))  # types and ranges: the schema's (a programmatic config too)
        n = len(self.stages)
        for k, st in enumerate(self.stages):
            try:
                check_stage(st.kind, st.model, st.role)
            except KindError as exc:
                raise ValueError(f"pipeline config: stage {k}: {exc}") from None
        if not self.final_stage_ids:
            raise ValueError("pipeline config: final_stages must name at least one stage")
        bad = [k for k in self.final_stage_ids if not 0 <= k < n]
        if bad:
            raise ValueError(f"pipeline config: final_stages {bad} out of range for {n} stages")
        if self.heartbeat_interval > 0 and self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("pipeline config: heartbeat_timeout must exceed heartbeat_interval")
        self._check_devices()
        self._check_roles()
        self._check_features()
        self._check_fit()
        return self

    def admission_bounds(self, *, serving: bool) -> list[int | None]:
        """Each stage's ``max_inflight`` per live replica (None: no bound).

        A stage that does not set it gets its ``max_batch`` when ``serving``
        (what a worker computes at once: more would only wait inside it) and
        no bound otherwise.
        """
        out: list[int | None] = []
        for st in self.stages:
            n = st.max_inflight
            if n is None:
                out.append(st.max_batch if serving else None)
            else:
                out.append(n or None)
        return out

    def replica_device(self, k: int, r: int) -> str:
        """The device replica ``r`` of stage ``k`` asks for: its own, its stage's, or the pipeline's."""
        dev = self.stages[k].device
        if dev is None:
            return self.device
        return dev[r] if isinstance(dev, list) else dev

    def placement(self, k: int, r: int) -> Placement:
        """Where replica ``r`` of stage ``k`` runs: the device it is told, the environment it gets."""
        return place(self.replica_device(k, r))

    def stage_device(self, k: int) -> str:
        """Stage ``k``'s device where it names one for every replica, else the pipeline's (a worker
        joining from another host has no place in a per-replica list)."""
        dev = self.stages[k].device
        return dev if isinstance(dev, str) else self.device

    def devices(self) -> list[tuple[str, str]]:
        """``(who, device)`` of every replica started here, in order (``who`` names the stage)."""
        return [(f"stage {k} ({st.label}) replica {r}", self.replica_device(k, r))
                for k, st in enumerate(self.stages) for r in range(st.replicas)]

    def where(self) -> str:
        """Where the replicas run, for a person: ``cpu``, or each stage's devices when they differ."""
        per_stage = [sorted({self.replica_device(k, r) for r in range(st.replicas)} or {self.stage_device(k)})
                     for k, st in enumerate(self.stages)]
        if len({d for ds in per_stage for d in ds}) == 1:
            return per_stage[0][0]
        return ", ".join(f"stage {k} on {'/'.join(ds)}" for k, ds in enumerate(per_stage))

    def _check_devices(self) -> None:
        """A per-replica device list has one entry per replica."""
        for k, st in enumerate(self.stages):
            if isinstance(st.device, list) and len(st.device) != st.replicas:
                raise ValueError(f"pipeline config: stage {k} ({st.label}): device lists {len(st.device)} "
                                 f"devices, one per replica, but it has {st.replicas} replica(s)")

    def _check_roles(self) -> None:
        """A prefill stage is followed by its decode stage: same kind, same options; never a final stage."""
        st = self.stages
        for k, s in enumerate(st):
            nxt = st[k + 1] if k + 1 < len(st) else None
            if s.role == "prefill":
                if nxt is None or nxt.role != "decode":
                    raise ValueError(f"pipeline config: stage {k} has role 'prefill': stage {k + 1} must "
                                     "have role 'decode' (it continues from the prefill's KV cache)")
                if (nxt.kind, nxt.model) != (s.kind, s.model):
                    raise ValueError(f"pipeline config: stages {k} (prefill) and {k + 1} (decode) must have "
                                     "the same kind and model options: they are one model, split")
                if k in self.final_stage_ids:
                    raise ValueError(f"pipeline config: stage {k} (prefill) gives no output to show: "
                                     f"make its decode stage {k + 1} final instead")
            elif s.role == "decode" and (k == 0 or st[k - 1].role != "prefill"):
                raise ValueError(f"pipeline config: stage {k} has role 'decode': the stage before it must "
                                 "have role 'prefill'")

    def _check_fit(self) -> None:
        """Each stage reads what the stage before it emits (vocabulary, codebooks: :mod:`stages.fit`)."""
        sizes = []
        for k, st in enumerate(self.stages):
            try:
                sizes.append(stage_sizes(st.kind, st.model, st.role))
            except KindError as exc:
                raise ValueError(f"pipeline config: stage {k}: {exc}") from None
        check_fit([st.label for st in self.stages], sizes)

    def _check_features(self) -> None:
        """A built-in encoder feeds a later thinker, whose ``feature_dim`` is the encoder's ``dim``."""
        for k, s in enumerate(self.stages):
            if s.kind not in ("image-encoder", "audio-encoder"):
                continue
            if self.async_chunk:
                raise ValueError(f"pipeline config: stage {k} ({s.kind}) encodes whole requests: a pipeline "
                                 "with encoder stages runs stage by stage, not async_chunk")
            t = next((j for j in range(k + 1, len(self.stages)) if self.stages[j].kind == "thinker"), None)
            if t is None:
                raise ValueError(f"pipeline config: stage {k} ({s.kind}) feeds no thinker: its features "
                                 "are read by a later thinker stage only")
            if self.stages[t].role:
                raise ValueError(f"pipeline config: stage {k} ({s.kind}) feeds a split thinker (stage {t}, "
                                 f"role {self.stages[t].role!r}): its prefill/decode halves take no features")
            dim = s.model.get("dim", FEATURE_DIM)
            want = self.stages[t].model.get("feature_dim", FEATURE_DIM)
            if dim != want:
                raise ValueError(f"pipeline config: stage {k} ({s.kind}) makes rows of dim {dim}, but stage "
                                 f"{t} (thinker) reads feature_dim {want}: make them equal")

    def kinds(self) -> list[str]:
        return [s.kind for s in self.stages]

    def roles(self) -> list[str]:
        return [s.role for s in self.stages]

    def outputs(self) -> list[str]:
        """Each stage's output modality (``stages.registry.MODALITIES``)."""
        return outputs_of(self.kinds(), self.roles())

    def hands_off(self, k: int) -> bool:
        """Does stage ``k`` send its requests' data straight to stage k+1's replicas?"""
        if k + 1 >= len(self.stages):
            return False
        return self.async_chunk or self.stages[k].role == "prefill"

    def model_seed(self, k: int) -> int:
        """The seed stage ``k``'s replicas build their (dummy) weights and default sampling from.

        What defines the model decides it -- the pipeline seed, the kind and the
        model options -- never the stage's position or a replica's index: every
        replica of a stage holds the same weights (a seeded request answers the
        same whichever serves it), and the prefill and decode halves of a split
        model, like the unsplit one, are one model.  A stable hash (not Python's
        salted ``hash``), so a worker on another host computes the same.
        """
        st = self.stages[k]
        what = json.dumps([self.seed, st.kind, st.model], sort_keys=True).encode()
        return int.from_bytes(hashlib.blake2b(what, digest_size=4).digest(), "big") & 0x7FFFFFFF

    def with_overrides(self, *, async_chunk: bool | None = None, replicas: int | None = None,
                       device: str | None = None, max_retries: int | None = None,
                       seed: int | None = None) -> PipelineConfig:
        """A copy with command-line overrides applied: ``replicas`` and ``device`` apply to every stage
        (the command line wins over the file's per-stage devices)."""
        cfg = replace(self, stages=[replace(s) for s in self.stages])
        if async_chunk is not None:
            cfg.async_chunk = async_chunk
        if replicas is not None:
            for s in cfg.stages:
                s.replicas = replicas
        if device is not None:
            cfg.device = device
            for s in cfg.stages:
                s.device = None
        if max_retries is not None:
            cfg.max_retries = max_retries
        if seed is not None:
            cfg.seed = seed
        return cfg.validate()


def default_config(**pipeline: Any) -> PipelineConfig:
    """thinker -> talker -> code2wav, final-output stages 0 (text) and 2 (audio)."""
    stages = [StageConfig("thinker"), StageConfig("talker"), StageConfig("code2wav")]
    return PipelineConfig(stages, final_stage_ids=[0, 2], **pipeline).validate()


def pd_config(*, decode_replicas: int = 2, **pipeline: Any) -> PipelineConfig:
    """The speech pipeline with the thinker split: prefill -> decode (x ``decode_replicas``) -> talker
    -> code2wav; text from stage 1, audio from stage 3."""
    stages = [StageConfig("thinker", role="prefill"),
              StageConfig("thinker", role="decode", replicas=decode_replicas),
              StageConfig("talker"), StageConfig("code2wav")]
    return PipelineConfig(stages, final_stage_ids=[1, 3], **pipeline).validate()


def text2image_config(**pipeline: Any) -> PipelineConfig:
    """encoder (the thinker as a text encoder) -> diffusion; stage 1's image is the output."""
    stages = [StageConfig("encoder"), StageConfig("diffusion")]
    return PipelineConfig(stages, final_stage_ids=[1], **pipeline).validate()


def omni_in_config(**pipeline: Any) -> PipelineConfig:
    """image-encoder -> audio-encoder -> thinker: a chat's images and sounds become features the
    thinker reads before the prompt; stage 2's text is the output."""
    stages = [StageConfig("image-encoder"), StageConfig("audio-encoder"), StageConfig("thinker")]
    return PipelineConfig(stages, final_stage_ids=[2], **pipeline).validate()


#: The built-in pipelines, by the name ``--pipeline`` takes.
PIPELINES = {"speech": default_config, "speech-pd": pd_config, "text2image": text2image_config,
             "omni-in": omni_in_config}


def builtin_config(name: str) -> PipelineConfig:
    """A built-in pipeline by name (ValueError naming the choices)."""
    make = PIPELINES.get(name)
    if make is None:
        raise ValueError(f"unknown pipeline {name!r} (built-in: {', '.join(PIPELINES)})")
    return make()


def checkpoint_config(path: str, *, max_model_len: int | None = None, dtype: str = "auto",
                      **pipeline: Any) -> PipelineConfig:
    """The pipeline that serves the Hugging Face checkpoint in directory ``path``, chosen from its
    ``config.json`` architectures: a causal LM is one ``hf-causal-lm`` stage giving text; a
    Qwen2.5-Omni model is its thinker (text, stage 0), talker and token2wav (audio, stage 2), each
    stage loading only its part (``omni-thinker``, ``omni-talker``, ``omni-token2wav``).

    ValueError (naming the path) for a directory that is not a checkpoint this project serves, or a
    ``max_model_len`` over the model's context; nothing is started.
    """
    from stages.hf.checkpoint import DTYPES, load_checkpoint

    ckpt = load_checkpoint(path)
    options: dict[str, Any] = {"checkpoint": str(ckpt.path), "dtype": dtype}
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if max_model_len is not None:
        options["max_model_len"] = ckpt.context(max_model_len)
    if ckpt.is_pipeline:
        from stages.hf.omni.checkpoint import read_omni_config

        read_omni_config(ckpt.path)  # its three parts' ids and its speakers, checked before any worker
        part = {"checkpoint": str(ckpt.path)}
        stages = [StageConfig("omni-thinker", model=options, name="thinker"),
                  StageConfig("omni-talker", model={**part, "dtype": dtype}, name="talker"),
                  StageConfig("omni-token2wav", model=part, name="token2wav")]
        # a real model's step (a long prefill, a long solve) can take seconds on a CPU: a worker is
        # declared hung after 30 s of silence, not the toys' 5
        pipeline = {"heartbeat_timeout": 30.0, **pipeline}
        return PipelineConfig(stages, final_stage_ids=[0, 2], **pipeline).validate()
    stage = StageConfig("hf-causal-lm", model=options, name=ckpt.architecture)
    return PipelineConfig([stage], final_stage_ids=[0], **pipeline).validate()


def echo_config(num_stages: int = 3, *, final_stage_ids: list[int] | None = None, replicas: int = 1,
                outputs: int = 1, worker_args: list[str] | None = None, **pipeline: Any) -> PipelineConfig:
    """A torch-free pipeline of echo stages (each echoes its input ``outputs`` times)."""
    stages = [StageConfig("echo", replicas=replicas, model={"outputs": outputs},
                          worker_args=list(worker_args or [])) for _ in range(num_stages)]
    finals = final_stage_ids if final_stage_ids is not None else [num_stages - 1]
    return PipelineConfig(stages, final_stage_ids=list(finals), **pipeline).validate()


# ---------------------------------------------------------------------------- the file's layout
#: the ``[pipeline]`` table: :class:`PipelineConfig`'s fields (their types, ranges and defaults), less
#: ``stages``; its final stages are ``final_stages`` (or, in older files, ``final_stage_ids``), and a file
#: that names neither has its last stage as the final one
_SETTINGS = {f.name: f for f in msgspec.structs.fields(PipelineConfig) if f.name != "stages"}
_FINALS = ("final_stages", "final_stage_ids")  # one setting, two spellings: neither given is UNSET


def _default(f: msgspec.structs.FieldInfo) -> Any:
    return f.default if f.default is not msgspec.NODEFAULT else field(default_factory=f.default_factory)


PipelineTable: type[Struct] = msgspec.defstruct(
    "PipelineTable",
    [(f.name, f.type, _default(f)) for f in _SETTINGS.values() if f.name not in _FINALS]
    + [(name, _SETTINGS["final_stage_ids"].type | UnsetType, UNSET) for name in _FINALS],
    forbid_unknown_fields=True, omit_defaults=True, module=__name__)


class ConfigFile(Struct, forbid_unknown_fields=True):
    """A whole config file: a ``[pipeline]`` table (optional) and at least one ``[[stages]]``."""

    stages: Annotated[list[StageConfig], Meta(min_length=1)]
    pipeline: PipelineTable = field(default_factory=PipelineTable)  # type: ignore[valid-type]


def check_file(data: Any) -> ConfigFile:
    """The parsed TOML layout, checked (ConfigError naming the key's path)."""
    if not isinstance(data, dict) or "stages" not in data:
        raise ConfigError("pipeline config: a [[stages]] table array with at least one stage is needed")
    try:
        checked = convert(data, ConfigFile, str_keys=True)  # TOML's keys are strings: replica_args' too
    except Invalid as exc:
        where = explain(exc, {"pipeline": PipelineTable, "stages": StageConfig}, ConfigFile)
        raise ConfigError(f"pipeline config: {where}") from None
    pipe = checked.pipeline
    if pipe.final_stages is not UNSET and pipe.final_stage_ids is not UNSET:
        raise ConfigError("pipeline config: pipeline: final_stages and final_stage_ids are one setting; "
                          "give one")
    return checked


def to_dict(cfg: PipelineConfig) -> dict[str, Any]:
    """The TOML layout of ``cfg`` (what :func:`from_dict` reads), e.g. to hand it to a remote worker."""
    pipe = msgspec.to_builtins(cfg, str_keys=True)
    stages = pipe.pop("stages")
    pipe["final_stages"] = pipe.pop("final_stage_ids")
    return {"pipeline": pipe, "stages": stages}


def from_dict(data: dict[str, Any]) -> PipelineConfig:
    """Build a config from the parsed TOML layout (see the module docstring).

    Checked against the layout first (:func:`check_file`): a wrong type, a
    value out of range, an unknown key or table is a ``ValueError`` naming
    the key's path; keys left out take the fields' defaults.
    """
    checked = check_file(data)
    pipe = checked.pipeline
    settings = {f: getattr(pipe, f) for f in pipe.__struct_fields__ if f not in _FINALS}
    finals = pipe.final_stages if pipe.final_stages is not UNSET else pipe.final_stage_ids
    final_stage_ids = list(finals) if finals is not UNSET else [len(checked.stages) - 1]
    return PipelineConfig(list(checked.stages), final_stage_ids=final_stage_ids, **settings).validate()


def load_config(path: str | Path) -> PipelineConfig:
    """Read a TOML pipeline file; errors name the file."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read pipeline config {p}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"pipeline config {p} is not valid TOML: {exc}") from None
    try:
        return from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{p}: {exc}") from None
