"""The realtime session: OpenAI's Realtime protocol (text in; text and audio out), with no I/O here.

``trio-orch serve`` speaks it on ``/v1/realtime`` (the socket side is
:mod:`trio_orch.http.routes.realtime`), so the official ``openai`` SDK's
``client.realtime.connect(model=...)`` drives it.  The client adds
conversation items (``conversation.item.create``: text messages) and asks
for a response (``response.create``); the server answers with the events and
fields of OpenAI's GA Realtime API (``response.created``, output item and
content part events, ``response.output_text.delta`` or
``response.output_audio_transcript.delta`` + ``response.output_audio.delta``,
their ``.done`` events, ``response.done`` with its ``status``, ``error``).
The audio goes out in the session's (or the response's) output format: 24 kHz
PCM or G.711 at 8 kHz, encoded by :class:`~trio_orch.openai.audio_out.AudioStream`.

What the pipeline makes of it: a session runs **one resumable request**,
started by its first response; every later response is the next input
segment of that same request (the items added since the previous response,
as ``role: text`` lines ending in ``assistant:``), so the thinker continues
from what it already heard and said.  ``response.cancel`` aborts that
request on every stage; the next response then starts a new request, which
does not carry the earlier context.  What is fixed when the request starts
(the output modality, the voice, ``max_output_tokens``) can change only
while no request is live.  docs/openai-compat.md ("Realtime") has the
tables: which events and fields are supported, which are refused, and why.

:class:`RealtimeSession` turns client frames into server events plus
*actions* (:class:`Start`, :class:`Append`, :class:`Cancel`) for the socket
side to perform, and the request's messages into server events.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stages.registry import as_audio, as_text, text_stage
from stages.sampling_params import StageParams
from trio_orch.openai.realtime_events import (
    AUDIO_FORMAT,
    Refused,
    Response,
    check_audio,
    check_item,
    check_limit,
    check_modalities,
    error_event,
    output_format,
    parse_frame,
)
from trio_orch.openai.sampling import SamplingError, map_sampling
from trio_orch.types import Message, OrchError

__all__ = ["Action", "Append", "Cancel", "RealtimeSession", "Start"]

log = logging.getLogger("trio_orch.openai.realtime")

MAX_ITEMS = 256  # conversation items kept for retrieve and previous_item_id


@dataclass(frozen=True, slots=True)
class Start:
    """Add the session's (resumable) request: ``prompt`` is its first segment."""

    request_id: str
    response_id: str
    prompt: str
    final_stage_id: int | None
    sampling: dict[int, dict[str, Any]] | None


@dataclass(frozen=True, slots=True)
class Append:
    """Send the request its next input segment (one response)."""

    request_id: str
    response_id: str
    segment: str


@dataclass(frozen=True, slots=True)
class Cancel:
    """Abort the request on every stage."""

    request_id: str


Action = Start | Append | Cancel


@dataclass(slots=True)
class _Request:
    id: str
    final_stage_id: int | None
    expected: frozenset[int]  # the final stages whose segment_done closes a response
    segments: int = 0  # input segments sent
    cancelled: bool = False  # we asked for its abort
    instructions: str = ""  # the session instructions it was last sent


class RealtimeSession:
    """The state of one session.  Not thread-safe; the socket side calls it from one task at a time.

    ``final_stage_ids`` and ``outputs`` (each stage's output modality, or None
    to judge outputs by their shape) describe the pipeline; ``stage_params``
    what its stages take (for ``voice`` and ``max_output_tokens``).
    ``served``: the model names the server answers to; a ``session.update``
    naming another is refused (``model_not_found``), as the handshake is
    (None: any name is echoed).  Limits:
    ``max_event_bytes`` per client frame, ``max_input_chars`` of item text
    waiting for a response (both answered with an ``error`` event).
    """

    def __init__(self, session_id: str, *, final_stage_ids: frozenset[int] | set[int],
                 outputs: Sequence[str] | None = None, stage_params: Sequence[StageParams] | None = None,
                 model: str | None = None, served: Sequence[str] | None = None,
                 max_event_bytes: int = 256 * 1024, max_input_chars: int = 64 * 1024) -> None:
        self.session_id = session_id
        self.final_stage_ids = frozenset(final_stage_ids)
        self.outputs = list(outputs) if outputs is not None else None
        self.stage_params = stage_params
        self.max_event_bytes = max_event_bytes
        self.max_input_chars = max_input_chars
        self.served = tuple(served) if served is not None else None
        self.model = model or (self.served[0] if self.served else "trio-orch")
        self.text_stage = text_stage(self.final_stage_ids, self.outputs)
        self.has_audio = any(self.outputs is None or self.outputs[k] in ("audio", "data")
                             for k in self.final_stage_ids)
        self.modalities = ["audio"] if self.has_audio else ["text"]
        self.instructions = ""
        self.voice: str | None = None
        self.output_format = "audio/pcm"  # a key of REALTIME_OUT; a response may ask for another
        self.max_output_tokens: int | str = "inf"
        self.items: dict[str, dict[str, Any]] = {}  # id -> item, in conversation order (the last MAX_ITEMS)
        self.pending: list[str] = []  # ids of the items no response has taken yet
        self.pending_chars = 0
        self.request: _Request | None = None
        self.response: Response | None = None
        self._n = 0
        self._ignored: set[tuple[str, str]] = set()

    def _id(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self.session_id}_{self._n}"

    # ------------------------------------------------------------------ client side
    def opened(self) -> list[dict[str, Any]]:
        """The first event of the session."""
        return [self._event("session.created", session=self.describe())]

    def receive(self, frame: str | bytes) -> tuple[list[dict[str, Any]], list[Action]]:
        """One client frame -> (events to send now, actions to perform, in order)."""
        event_id = None
        try:
            event = parse_frame(frame, self.max_event_bytes)
            event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            return self._apply(event)
        except Refused as exc:
            return [self.error(exc.code, str(exc), event_id, param=exc.param)], []

    def _apply(self, event: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Action]]:
        kind = event["type"]
        if kind == "session.update":
            return self._update_session(event.get("session")), []
        if kind == "conversation.item.create":
            return self._create_item(event), []
        if kind in ("conversation.item.retrieve", "conversation.item.delete"):
            item_id = event.get("item_id")
            if not isinstance(item_id, str) or item_id not in self.items:
                raise Refused("item_not_found", f"{kind}: no item {item_id!r} in the conversation", "item_id")
            if kind == "conversation.item.retrieve":
                return [self._event("conversation.item.retrieved", item=self.items[item_id])], []
            if item_id not in self.pending:
                raise Refused("item_in_use", f"item {item_id!r} was already taken by a response: the "
                                             "pipeline has heard it, it cannot be deleted", "item_id")
            self.pending.remove(item_id)
            self.pending_chars -= _chars(self.items.pop(item_id))
            return [self._event("conversation.item.deleted", item_id=item_id)], []
        if kind == "response.create":
            return self._create_response(event.get("response"))
        return self._cancel(event.get("response_id"))

    def _update_session(self, cfg: Any) -> list[dict[str, Any]]:
        if not isinstance(cfg, dict):
            raise Refused("invalid_session", "session.update needs a \"session\" object", "session")
        if cfg.get("type", "realtime") != "realtime":
            raise Refused("invalid_session", "only \"type\": \"realtime\" sessions are served here "
                                             "(no transcription sessions)", "session.type")
        if cfg.get("tools"):
            raise Refused("unsupported_value", "tools are not supported", "session.tools")
        modalities, voice, limit = self.modalities, self.voice, self.max_output_tokens
        fmt = self.output_format
        if "output_modalities" in cfg:
            modalities = self._modalities(cfg["output_modalities"], "session.output_modalities")
        audio = cfg.get("audio")
        if audio is not None:
            voice, fmt = check_audio(audio, voice, fmt, "session.audio")
        if "max_output_tokens" in cfg:
            limit = check_limit(cfg["max_output_tokens"], "session.max_output_tokens")
        if "model" in cfg and self.served is not None and cfg["model"] not in self.served:
            raise Refused("model_not_found", f"The model {cfg['model']!r} is not served here (this server "
                          f"serves {', '.join(repr(n) for n in self.served)})", "session.model")
        if "instructions" in cfg:
            if not isinstance(cfg["instructions"], str):
                raise Refused("invalid_value", "instructions must be a string", "session.instructions")
        fixed = (modalities, voice, limit) != (self.modalities, self.voice, self.max_output_tokens)
        if fixed and self.request is not None:
            raise Refused("session_active", "output_modalities, voice and max_output_tokens are fixed while "
                                            "the session's request is live (from its first response until it "
                                            "is cancelled or fails)", "session")
        self._sampling(modalities, voice, limit)  # refused here if the pipeline cannot honour them
        self.modalities, self.voice, self.max_output_tokens = modalities, voice, limit
        self.output_format = fmt  # not fixed while a request is live: it shapes only the encoding
        self.instructions = cfg.get("instructions", self.instructions)
        if isinstance(cfg.get("model"), str):
            self.model = cfg["model"]
        self._note_ignored(cfg, {"type", "tools", "output_modalities", "audio", "max_output_tokens",
                                 "instructions", "model"}, "session")
        return [self._event("session.updated", session=self.describe())]

    def _modalities(self, mods: Any, param: str) -> list[str]:
        return check_modalities(mods, text=self.text_stage is not None, audio=self.has_audio, param=param)

    def _sampling(self, modalities: list[str], voice: str | None, limit: int | str
                  ) -> dict[int, dict[str, Any]] | None:
        fields: dict[str, Any] = {"max_tokens": limit if isinstance(limit, int) else None,
                                  "voice": voice if modalities == ["audio"] else None}
        if all(v is None for v in fields.values()):
            return None
        finals = sorted(self.final_stage_ids)
        last = self.text_stage if modalities == ["text"] else (finals[-1] if finals else 0)
        try:
            return map_sampling(fields, self.stage_params, text_stage=self.text_stage,
                                last_stage=last if last is not None else 0)
        except SamplingError as exc:
            param = {"max_tokens": "session.max_output_tokens", "audio.voice": "session.audio.output.voice"}
            raise Refused("unsupported_value", str(exc).replace("'max_tokens'", "'max_output_tokens'"),
                          param.get(exc.param, exc.param)) from None

    def _create_item(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        item, text = check_item(event.get("item"))
        previous = next(reversed(self.items), None)
        if event.get("previous_item_id") not in (None, previous) and not (
                event.get("previous_item_id") == "root" and previous is None):
            raise Refused("unsupported_value", f"items are added at the end of the conversation only "
                          f"(previous_item_id: null or {previous!r})", "previous_item_id")
        item_id = item.get("id") or self._id("item")
        if item_id in self.items:
            raise Refused("invalid_value", f"the conversation already has an item {item_id!r}", "item.id")
        if self.pending_chars + len(text) > self.max_input_chars:
            raise Refused("input_too_large", f"the items waiting for a response would hold "
                          f"{self.pending_chars + len(text)} characters, over the limit of "
                          f"{self.max_input_chars}: create a response first", "item")
        item = {**item, "id": item_id, "object": "realtime.item", "status": "completed"}
        self._remember(item)
        self.pending.append(item_id)
        self.pending_chars += len(text)
        return [self._event("conversation.item.added", previous_item_id=previous, item=item),
                self._event("conversation.item.done", previous_item_id=previous, item=item)]

    def _remember(self, item: dict[str, Any]) -> None:
        self.items[item["id"]] = item
        while len(self.items) > MAX_ITEMS:
            oldest = next(iter(self.items))
            if oldest in self.pending:
                break
            del self.items[oldest]

    def _create_response(self, params: Any) -> tuple[list[dict[str, Any]], list[Action]]:
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise Refused("invalid_value", "response must be an object", "response")
        if self.response is not None:
            raise Refused("conversation_already_has_active_response",
                          f"response {self.response.id} is in progress: wait for its response.done "
                          "or cancel it", "type")
        if params.get("conversation", "auto") != "auto" or "input" in params:
            raise Refused("unsupported_value", "out-of-band responses (conversation: none, input) are not "
                                               "supported: a response answers the default conversation",
                          "response.conversation" if "input" not in params else "response.input")
        if params.get("tools"):
            raise Refused("unsupported_value", "tools are not supported", "response.tools")
        if "output_modalities" in params and self._modalities(
                params["output_modalities"], "response.output_modalities") != self.modalities:
            raise Refused("unsupported_value", "a response has the session's output_modalities: change them "
                                               "with session.update", "response.output_modalities")
        voice, fmt = (check_audio(params["audio"], self.voice, self.output_format, "response.audio")
                      if "audio" in params else (self.voice, self.output_format))
        if voice != self.voice:
            raise Refused("unsupported_value", "a response has the session's voice: change it with "
                                               "session.update", "response.audio.output.voice")
        if "max_output_tokens" in params and check_limit(
                params["max_output_tokens"], "response.max_output_tokens") != self.max_output_tokens:
            raise Refused("unsupported_value", "a response has the session's max_output_tokens: change it "
                                               "with session.update", "response.max_output_tokens")
        instructions = params.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise Refused("invalid_value", "instructions must be a string", "response.instructions")
        metadata = params.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise Refused("invalid_value", "metadata must be an object", "response.metadata")
        lines = [f"{self.items[i]['role']}: {_text(self.items[i])}" for i in self.pending
                 if _text(self.items[i]).strip()]
        if not lines:
            raise Refused("no_input", "response.create: no conversation item was added since the last "
                                      "response (add one with conversation.item.create)", "type")
        sent = self.request.instructions if self.request is not None else ""
        system = instructions if instructions is not None else (
            self.instructions if self.instructions != sent else "")
        prompt = "\n".join(([f"system: {system}"] if system.strip() else []) + lines + ["assistant:"])
        self.pending.clear()
        self.pending_chars = 0
        self._note_ignored(params, {"conversation", "tools", "output_modalities", "audio",
                                    "max_output_tokens", "instructions", "metadata"}, "response")
        action: Action
        if self.request is None:
            last = self.text_stage if self.modalities == ["text"] else None
            top = last if last is not None else max(self.final_stage_ids, default=0)
            expected = frozenset(k for k in self.final_stage_ids if k <= top)
            self.request = _Request(self._id("req"), last, expected)
            rid = self._id("resp")
            action = Start(self.request.id, rid, prompt, last,
                           self._sampling(self.modalities, self.voice, self.max_output_tokens))
        else:
            rid = self._id("resp")
            action = Append(self.request.id, rid, prompt)
        if instructions is None:  # a response's own instructions are for it alone
            self.request.instructions = self.instructions
        previous = next(reversed(self.items), None)
        self.response = Response(rid, self._id("item"), self.request.segments, list(self.modalities),
                                 self._resource_extras(metadata, fmt), previous, fmt)
        self._remember(self.response.item("in_progress"))
        self.request.segments += 1
        return self.response.created(self._event), [action]

    def _cancel(self, response_id: Any) -> tuple[list[dict[str, Any]], list[Action]]:
        r = self.response
        if r is None:
            raise Refused("response_cancel_not_active", "there is no response in progress to cancel")
        if response_id is not None and response_id != r.id:
            raise Refused("response_cancel_not_active", f"response {response_id!r} is not in progress "
                                                        f"({r.id} is)", "response_id")
        if self.request is None or self.request.cancelled:
            return [], []  # already being cancelled: its response.done follows
        self.request.cancelled = True
        return [], [Cancel(self.request.id)]

    # ------------------------------------------------------------------ the request's side
    def request_failed(self, response_id: str, exc: BaseException) -> list[dict[str, Any]]:
        """A Start was refused (shed, stopping, bad parameters): its response fails, no request is live."""
        self.request = None
        return self._fail(response_id, "request_refused", f"the request was refused: {exc}")

    def update_failed(self, response_id: str, exc: BaseException) -> list[dict[str, Any]]:
        """An Append was refused (the request ended meanwhile): its response fails."""
        return self._fail(response_id, "update_refused", f"the input segment was not taken: {exc}")

    def _fail(self, response_id: str, code: str, message: str) -> list[dict[str, Any]]:
        if self.response is None or self.response.id != response_id:
            return []  # that response has already ended
        return self._end("failed", {"type": "failed", "error": {"type": "server_error", "code": code,
                                                                "message": message}})

    def output(self, m: Message) -> list[dict[str, Any]]:
        """One message of the session's request -> the events it causes."""
        req = self.request
        if req is None or m.request_id != req.id:
            return []  # from a request that has ended
        if isinstance(m, OrchError):
            self.request = None
            if self.response is None:
                return [] if req.cancelled else [self.error(
                    m.kind, f"the session's request ended: {m.message}", kind="server_error")]
            if m.kind == "aborted":
                return self._end("cancelled", {"type": "cancelled",
                                               "reason": "client_cancelled" if req.cancelled else None})
            return self._end("failed", {"type": "failed", "error": {"type": "server_error", "code": m.kind,
                                                                    "message": m.message}})
        r = self.response
        if m.finished:
            self.request = None
        if r is None or m.segment != r.segment:
            return []
        modality = self.outputs[m.stage_id] if self.outputs is not None else "data"
        text = as_text(modality, m.data)
        events: list[dict[str, Any]] = []
        if text:
            events.append(r.text_delta(self._event, m.stage_id, text))
        elif text is None and r.modalities == ["audio"]:
            audio = as_audio(modality, m.data)
            if audio is not None and len(audio[0]):
                events += r.audio_delta(self._event, *audio)
        if m.segment_done or m.finished:
            events += r.stage_done(self._event, m.stage_id, m.stage_id == self.text_stage)
            if r.closed >= req.expected or m.finished:
                events += self._end("completed", None)
        return events

    def _end(self, status: str, details: dict[str, Any] | None) -> list[dict[str, Any]]:
        r = self.response
        assert r is not None
        self.response = None
        events = r.done(self._event, status, details)
        self._remember(r.item(status))
        return events

    # ------------------------------------------------------------------ helpers
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "event_id": self._id("event"), **fields}

    def error(self, code: str, message: str, event_id: str | None = None, *, param: str | None = None,
              kind: str = "invalid_request_error") -> dict[str, Any]:
        return error_event(self._id("event"), kind, code, message, param, event_id)

    def _note_ignored(self, given: dict[str, Any], known: set[str], where: str) -> None:
        for name in sorted(set(given) - known - {"event_id"}):
            if (where, name) not in self._ignored:  # once per session and field
                self._ignored.add((where, name))
                log.info("realtime session %s: %s.%s is not supported; ignored", self.session_id, where, name)

    def _resource_extras(self, metadata: dict[str, Any] | None, fmt: str) -> dict[str, Any]:
        return {"conversation_id": f"conv_{self.session_id}", "output_modalities": list(self.modalities),
                "audio": {"output": {"format": output_format(fmt), "voice": self.voice}},
                "max_output_tokens": self.max_output_tokens, "metadata": metadata}

    def describe(self) -> dict[str, Any]:
        """The session resource (``session.created`` / ``session.updated``)."""
        return {"type": "realtime", "object": "realtime.session", "id": self.session_id, "model": self.model,
                "output_modalities": list(self.modalities), "instructions": self.instructions,
                "audio": {"input": {"format": AUDIO_FORMAT, "turn_detection": None},
                          "output": {"format": output_format(self.output_format), "voice": self.voice}},
                "max_output_tokens": self.max_output_tokens, "tools": [], "tool_choice": "auto",
                "max_event_bytes": self.max_event_bytes, "max_input_chars": self.max_input_chars}


def _text(item: dict[str, Any]) -> str:
    return "".join(p.get("text") or "" for p in item.get("content", []))


def _chars(item: dict[str, Any]) -> int:
    return len(_text(item))

