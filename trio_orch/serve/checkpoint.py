"""A Hugging Face checkpoint on the command line: ``serve MODEL_DIR`` (or ``--model``), ``generate --model``.

``serve`` takes the directory as vLLM's ``vllm serve`` does (positional, or
``--model``: the same; argparse never takes ``--model`` as a prefix of
``--model-name``), with vLLM's ``--max-model-len`` and ``--dtype``;
``generate`` takes ``--model``.  Everything is checked before any worker
starts (:func:`checkpoint_pipeline`): a path that is not a checkpoint
directory, an architecture not served, a missing ``hf`` extra or a bad
``--max-model-len`` is a ValueError naming it (exit 2).  The pipeline is
chosen from the checkpoint's ``config.json`` (:func:`stages.config.checkpoint_config`);
the chat template and special tokens are the checkpoint's
(:func:`checkpoint_template`; ``--chat-template`` overrides); ``/tokenize``
and the prompt counts use its tokenizer because its stage reports it.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from stages.config import PipelineConfig, builtin_config, checkpoint_config, load_config
from stages.hf.checkpoint import DTYPES, load_checkpoint
from stages.hf.tokenizer import require_transformers
from trio_orch.openai.chat_template import ChatTemplate

__all__ = ["add_model_arguments", "add_stage_config_argument", "checkpoint_pipeline", "checkpoint_template",
           "describe", "model_dir", "pipeline_config", "resolve_model"]

log = logging.getLogger("trio_orch.serve.checkpoint")


def add_model_arguments(parser: argparse.ArgumentParser, *, positional: bool) -> None:
    """``--model`` (and, for ``serve``, the positional MODEL_DIR), ``--max-model-len``, ``--dtype``."""
    g = parser.add_argument_group("a Hugging Face checkpoint (docs/models.md; needs the hf extra)")
    if positional:
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL_DIR",
                            help="serve the Hugging Face checkpoint in this local directory (config.json, "
                                 "safetensors, tokenizer), as 'vllm serve MODEL' does: the pipeline is "
                                 "chosen from its config.json architectures (a causal LM: one text stage); "
                                 "nothing is downloaded")
    same = " (the same as the positional MODEL_DIR)" if positional else ": its pipeline instead of the toys"
    g.add_argument("--model", default=None, metavar="MODEL_DIR", help="the checkpoint directory" + same)
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="the model's context in tokens: prompt plus max_tokens beyond it is a 400 (default: "
                        "the checkpoint's config.json; at most that)")
    g.add_argument("--dtype", choices=list(DTYPES), default="auto",
                   help="the weights' dtype (default auto: the checkpoint's)")


def model_dir(args: argparse.Namespace) -> str | None:
    """The checkpoint directory asked for (positional or ``--model``), or None; ValueError if both
    are given and differ, or ``--max-model-len`` / ``--dtype`` come without one."""
    tag, flag = getattr(args, "model_tag", None), args.model
    if tag is not None and flag is not None and tag != flag:
        raise ValueError(f"two checkpoints given: MODEL_DIR {tag} and --model {flag}: give one")
    path = tag if tag is not None else flag
    if path is None:
        if args.max_model_len is not None or args.dtype != "auto":
            raise ValueError("--max-model-len and --dtype apply to a checkpoint: give MODEL_DIR or --model")
        return None
    for other in ("config", "pipeline"):
        if getattr(args, other, None):
            raise ValueError(f"give a checkpoint (MODEL_DIR, --model) or --{other}, not both")
    if getattr(args, "in_process", False):
        raise ValueError("give a checkpoint (MODEL_DIR, --model) or --in-process, not both")
    return str(path)


def resolve_model(args: argparse.Namespace) -> str | None:
    """``serve``'s checkpoint (:func:`model_dir`) set as ``args.model_dir``, and the served names'
    default: the checkpoint as given (vLLM's), else ``trio-orch``."""
    args.model_dir = model_dir(args)
    if args.served_model_name is None:
        args.served_model_name = [args.model_dir or "trio-orch"]
    return args.model_dir


def checkpoint_pipeline(path: str, args: argparse.Namespace) -> PipelineConfig:
    """The checkpoint's pipeline, every check made (ValueError naming the path or the flag)."""
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError(f"--max-model-len must be >= 1, got {args.max_model_len}")
    cfg = checkpoint_config(path, max_model_len=args.max_model_len, dtype=args.dtype)
    try:
        require_transformers()
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    return cfg


def add_stage_config_argument(parser: argparse.ArgumentParser) -> None:
    """``--stage-config FILE``: per-stage settings over the pipeline the other flags chose."""
    parser.add_argument("--stage-config", default=None, metavar="FILE",
                        help="TOML of per-stage settings laid over the pipeline (a checkpoint's, "
                             "--config's or --pipeline's), as vLLM-Omni's stage configs: [stages.NAME] "
                             "tables (a stage by name, kind or index) with device, replicas, max_batch, "
                             "model options..., and an optional [pipeline] table; --device and --replicas "
                             "still win (docs/models.md: Placement)")


def pipeline_config(args: argparse.Namespace) -> PipelineConfig:
    """The pipeline the command line asks for (``args.model_dir`` resolved already), every check made
    before any worker starts: ValueError naming the flag, the file or the key."""
    if args.config and args.pipeline:
        raise ValueError("give --config or --pipeline, not both")
    if args.model_dir:
        cfg = checkpoint_pipeline(args.model_dir, args)
    else:
        cfg = load_config(args.config) if args.config else builtin_config(args.pipeline or "speech")
    if args.stage_config:
        from stages.overlay import apply_overlay, load_overlay

        try:
            cfg = apply_overlay(cfg, load_overlay(args.stage_config))
        except ValueError as exc:
            msg = str(exc)
            raise ValueError(msg if msg.startswith(("cannot read", "stage config")) else
                             f"stage config {args.stage_config}: {msg}") from None
    return cfg.with_overrides(async_chunk=args.async_chunk, replicas=args.replicas, device=args.device,
                              max_retries=args.max_retries)


def checkpoint_template(path: str) -> ChatTemplate | None:
    """The checkpoint's chat template with its special tokens (None: it has none)."""
    ckpt = load_checkpoint(path)
    if ckpt.chat_template is None:
        return None
    return ChatTemplate(ckpt.chat_template, f"{ckpt.path}'s chat template", bos_token=ckpt.bos_token or "",
                        eos_token=ckpt.eos_token or "")


def describe(cfg: PipelineConfig) -> str:
    """What ``serve`` and ``generate`` print when they start."""
    st = cfg.stages[0]
    options: dict[str, Any] = st.model
    return f"checkpoint {options['checkpoint']} ({st.name}, {st.kind}) on {cfg.where()}"
