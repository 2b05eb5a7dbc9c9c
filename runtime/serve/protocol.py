"""OpenAI's wire format: request bodies checked into a :class:`GenerationRequest`, and the
JSON of responses, server-sent-event chunks and errors built from the runtime's results.

Follows the OpenAI API reference for ``POST /v1/chat/completions`` and ``POST
/v1/completions`` (``stream``, ``stream_options.include_usage``, ``finish_reason``,
``usage`` with ``prompt_tokens_details.cached_tokens``: the prompt tokens whose KV rows
came from the previous turn). Extensions, as llama.cpp's server takes them: ``top_k``,
``repetition_penalty``. Refused with a 400 naming the field: ``n`` > 1, non-zero
``presence_penalty`` / ``frequency_penalty``, ``logprobs``, ``tools``, ``echo``,
``suffix``, a batch of prompts. Fields it does not know are ignored (clients add ``user``,
``metadata``...). Needs no web framework (plain dicts).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

#: ``GenerationResult.finish_reasons`` -> OpenAI's ``finish_reason``
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
#: stop strings a request may give (OpenAI: 4)
MAX_STOP = 16


class RequestError(Exception):
    """A request the server answers with an error (OpenAI's error body).

    Args:
        status: HTTP status (400, 404, 413, 503...).
        message: what is wrong and what to do, in one line.
        param: the request field at fault, if any.
        code: a machine-readable code (``context_length_exceeded``, ``server_busy``...).
        kind: OpenAI's error ``type``.
        headers: extra response headers (``Retry-After``).
    """

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error",
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.headers = kind, dict(headers or {})

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class GenerationRequest:
    """One checked request: what to generate and how to answer.

    Attributes:
        kind: ``"chat"`` or ``"completion"``.
        prompt_ids: the prompt's token ids (a chat rendered with the model's template).
        max_tokens: tokens to generate at most (``None``: the rest of the context, up to
            the server's cap).
        sampling: keyword arguments of ``Session.stream`` (``temperature``, ``top_p``,
            ``top_k``, ``repetition_penalty``, ``seed``, ``stop``).
        stream: answer with server-sent events.
        include_usage: (streaming) add a last chunk with ``usage``.
    """

    kind: str
    prompt_ids: list
    max_tokens: Optional[int]
    sampling: dict = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False


def _bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> RequestError:
    return RequestError(400, message, param=param, code=code)


def _typed(body: dict, name: str, types: tuple, what: str, default: Any = None) -> Any:
    """``body[name]`` if it has one of ``types`` (bool never passes for a number)."""
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        raise _bad(f"'{name}' must be {what}, got {v!r}", name)
    return v


def _common(body: dict, kind: str) -> GenerationRequest:
    """The fields chat and completion requests share."""
    number = (int, float)
    n = _typed(body, "n", (int,), "1", 1)
    if n != 1:
        raise _bad("'n' must be 1 (one choice per request)", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _typed(body, name, number, "a number", 0) != 0:
            raise _bad(f"'{name}' is not supported", name)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise _bad("'logprobs' is not supported", "logprobs")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)
                             or len(stop) > MAX_STOP):
        raise _bad(f"'stop' must be a string or a list of at most {MAX_STOP} strings", "stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise _bad(f"'max_tokens' must be a positive integer, got {max_tokens!r}", "max_tokens")
    stream = _typed(body, "stream", (bool,), "true or false", False)
    opts = _typed(body, "stream_options", (dict,), "an object", {})
    sampling = {"temperature": _typed(body, "temperature", number, "a number", 1.0),
                "top_p": _typed(body, "top_p", number, "a number", 1.0),
                "top_k": _typed(body, "top_k", (int,), "an integer", 0),
                "repetition_penalty": _typed(body, "repetition_penalty", number, "a number", 1.0),
                "seed": _typed(body, "seed", (int,), "an integer", None),
                "stop": [s for s in (stop or []) if s] or None}
    if sampling["temperature"] > 2:
        raise _bad("'temperature' must be in [0, 2]", "temperature")
    return GenerationRequest(kind, [], max_tokens, sampling, stream,
                             bool(stream and opts.get("include_usage")))


def _text_content(content: Any, i: int) -> str:
    """A message's content: a string, or a list of ``{"type": "text", "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise _bad(f"messages[{i}].content: only text parts are supported",
                           f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts",
               f"messages[{i}].content")


def parse_chat(body: dict, tokenizer) -> GenerationRequest:
    """Check a ``/v1/chat/completions`` body and render its messages with the model's chat
    template (``runtime.tokenizer.Tokenizer``).

    Raises:
        RequestError: 400 naming the field.
        GenerationError: the template refuses the messages (no template, bad role order).
    """
    req = _common(body, "chat")
    if body.get("tools") or body.get("functions"):
        raise _bad("tools / function calling is not supported", "tools")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    conv = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a 'role' string", f"messages[{i}]")
        role = "system" if m["role"] == "developer" else m["role"]
        conv.append({"role": role, "content": _text_content(m.get("content"), i)})
    text = tokenizer.apply_chat_template(conv, add_generation_prompt=True)
    req.prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    return req


def parse_completion(body: dict, tokenizer) -> GenerationRequest:
    """Check a ``/v1/completions`` body: ``prompt`` is a string or token ids (or a list of
    one of them); ``max_tokens`` defaults to 16 as in OpenAI's API.

    Raises:
        RequestError: 400 naming the field.
    """
    req = _common(body, "completion")
    if body.get("echo") or body.get("suffix") or _typed(body, "best_of", (int,), "1", 1) != 1:
        raise _bad("'echo', 'suffix' and 'best_of' are not supported", "echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                      for t in prompt):
        req.prompt_ids = list(prompt)
    else:
        raise _bad("'prompt' must be a string or a list of token ids (one prompt per request)",
                   "prompt")
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        req.max_tokens = 16
    return req


def fit_max_tokens(req: GenerationRequest, max_length: int, cap: Optional[int]) -> int:
    """The tokens to generate: ``req.max_tokens``, or the rest of the context (at most
    ``cap``).

    Raises:
        RequestError: 400 ``context_length_exceeded`` when the prompt (plus
            ``max_tokens``) does not fit in ``max_length``.
    """
    n = len(req.prompt_ids)
    room = max_length - n + 1          # the last token is sampled, never cached
    if not req.prompt_ids:
        raise _bad("the prompt is empty", "prompt" if req.kind == "completion" else "messages")
    if room < 1 or (req.max_tokens is not None and req.max_tokens > room):
        want = f" + max_tokens {req.max_tokens}" if req.max_tokens is not None else ""
        raise _bad(f"the prompt ({n} tokens){want} exceeds the model's context of {max_length} "
                   "tokens", "max_tokens" if room >= 1 else "messages",
                   code="context_length_exceeded")
    if req.max_tokens is not None:
        return req.max_tokens
    return min(room, cap) if cap else room


# ----------------------------------------------------------------------- responses
class Reply:
    """The JSON objects of one answer (a response, or the chunks of a stream).

    Args:
        req: the request.
        model: the model name the server reports.
    """

    def __init__(self, req: GenerationRequest, model: str):
        self.req, self.model = req, model
        self.chat = req.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def usage(self, result, completion_tokens: Optional[int] = None) -> dict:
        """``usage`` of a ``GenerationResult`` (``cached_tokens``: the reused prefix)."""
        p = int(result.prompt_tokens[0]) if result is not None else len(self.req.prompt_ids)
        c = completion_tokens if completion_tokens is not None else \
            (len(result.token_ids[0]) if result is not None else 0)
        cached = int(getattr(result, "cached_tokens", 0) or 0) if result is not None else 0
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def response(self, text: str, finish: str, result) -> dict:
        """The whole (non-streamed) response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head(False), "choices": [choice], "usage": self.usage(result)}

    def chunk(self, text: Optional[str] = None, finish: Optional[str] = None,
              first: bool = False) -> dict:
        """One streamed chunk: the first (chat: the assistant role), a text piece, or the
        last one with ``finish_reason``."""
        if self.chat:
            delta: dict = {}
            if first:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        out = {**self._head(True), "choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, result) -> dict:
        """The last chunk of a stream with ``stream_options.include_usage``."""
        return {**self._head(True), "choices": [], "usage": self.usage(result)}


def finish_reason(reason: Optional[str]) -> str:
    """OpenAI's ``finish_reason`` for a ``TextStream.finish_reason``."""
    return FINISH_REASONS.get(reason or "", "stop")


__all__ = ["RequestError", "GenerationRequest", "Reply", "parse_chat", "parse_completion",
           "fit_max_tokens", "error_body", "finish_reason", "FINISH_REASONS"]
