"""The OpenAI-compatible wire format: request bodies checked into engine `Request`s, answers shaped back.

Bodies are plain JSON checked field by field (not a pydantic model), so that every bad input is
one `APIError` in OpenAI's error shape naming the field. The API is honest: a field of OpenAI's
completions or chat schema that would change the answer and that milo does not honour (sampling,
penalties, logprobs, tools, structured output, ...) is a 400 naming it unless its value asks for
nothing (``temperature: 0``, ``tools: []``); fields that change nothing (``user``, ``seed``: decoding
is greedy, ``metadata``, ...) are accepted and ignored, as clients send them. A chat is one user
message: milo answers one query against the demonstrations it retrieves, so a system message or
earlier turns, which it would drop, are refused.
"""
import json
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from ..runtime.interface import Answer
from ..runtime.planning import QueryPlan, Request

MAX_STOP_STRINGS = 4  # as OpenAI's API


class APIError(Exception):
    """A request the server refuses; rendered as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


@dataclass(frozen=True)
class ParsedRequest:
    """A checked body: which store answers, the engine request, and how to reply."""

    chat: bool
    model: str
    request: Request
    stream: bool
    include_usage: bool


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the body's JSON nests too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, not {type(body).__name__}", code="invalid_json")
    return body


def _optional_int(body: dict, name: str, *, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"between {low} and {high}"
        raise invalid(name, f"must be {bound}, got {value}")
    return value


def _text(value, name: str) -> str:
    """A prompt or message content: a string, or a list of one string / of text parts."""
    if isinstance(value, list):
        if all(isinstance(part, dict) and part.get("type") == "text" for part in value):
            value = "".join(str(part.get("text", "")) for part in value)
        elif len(value) == 1 and isinstance(value[0], str):
            value = value[0]
        else:
            raise invalid(name, "must be one string (batched prompts are not supported: send one request each)")
    if not isinstance(value, str):
        raise invalid(name, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise invalid(name, "is empty")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise invalid("stop", "must be a non-empty string or a list of them")
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    return tuple(stop)


def _is(target) -> Callable[[object], bool]:
    """Whether a field's value is absent or the number ``target`` (a bool is no number here)."""
    return lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == target)


def _empty(value) -> bool:
    return value is None or value in ("", [], {})


def _off(value) -> bool:
    return value is None or value is False


# Fields of OpenAI's completions and chat schemas that would change the answer and that milo does not
# honour: (name, whether a value asks for nothing, why it is refused otherwise).
UNHONOURED: tuple[tuple[str, Callable[[object], bool], str], ...] = (
    ("n", _is(1), "only n=1 is supported"),
    ("best_of", _is(1), "only best_of=1 is supported"),
    ("temperature", _is(0), "only greedy decoding (temperature 0) is supported"),
    ("top_p", _is(1), "only greedy decoding (top_p 1) is supported"),
    ("presence_penalty", _is(0), "penalties are not supported (greedy decoding only)"),
    ("frequency_penalty", _is(0), "penalties are not supported (greedy decoding only)"),
    ("logit_bias", _empty, "logit biases are not supported"),
    ("logprobs", _off, "log probabilities are not supported"),
    ("top_logprobs", _is(0), "log probabilities are not supported"),
    ("echo", _off, "echoing the prompt is not supported"),
    ("suffix", _empty, "a suffix (insertion) is not supported"),
    ("response_format", lambda v: v is None or v == {"type": "text"},
     "structured output is not supported: answers are plain text"),
    ("tools", _empty, "tool calling is not supported"),
    ("tool_choice", lambda v: v in (None, "none"), "tool calling is not supported"),
    ("functions", _empty, "function calling is not supported"),
    ("function_call", lambda v: v in (None, "none"), "function calling is not supported"),
    ("modalities", lambda v: v is None or v == ["text"], "only text output is supported"),
    ("audio", _empty, "audio output is not supported"),
    ("reasoning_effort", _empty, "the model does not reason: reasoning_effort cannot be honoured"),
    ("verbosity", _empty, "answers are not shaped by verbosity"),
    ("web_search_options", _empty, "web search is not supported"),
)


def _check_honoured(body: dict) -> None:
    """A 400 naming the first field that asks for what milo would not do."""
    for name, asks_nothing, why in UNHONOURED:
        value = body.get(name)
        if not asks_nothing(value):
            scalar = isinstance(value, (str, int, float)) and len(repr(value)) <= 60
            raise invalid(name, f"{why}, got {value!r}" if scalar else f"{why}, got a {type(value).__name__}")


def _only_user_message(body: dict) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of {role, content} objects")
    if len(messages) > 1 or not isinstance(messages[0], dict) or messages[0].get("role") != "user":
        raise invalid("messages", "must be exactly one message, the user's query: milo answers one query against "
                                  "the demonstrations it retrieves, so a system message or earlier turns would be "
                                  "dropped, not honoured")
    return _text(messages[0].get("content"), "messages")


def parse_request(body: dict, *, chat: bool, models, max_positions: int) -> ParsedRequest:
    """Check a completions (``chat`` False) or chat-completions body against the mounted ``models``."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "is required: the name of a mounted store (GET /v1/models lists them)")
    if model not in models:
        raise APIError(404, f"model {model!r} is not mounted here; mounted: {', '.join(sorted(models))}",
                       param="model", code="model_not_found")
    _check_honoured(body)
    text = _only_user_message(body) if chat else _text(body.get("prompt"), "prompt")
    length = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream", f"must be true or false, got {stream!r}")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise invalid("stream_options", "is only allowed with stream: true")
    options = options or {}
    if not isinstance(options, dict):
        raise invalid("stream_options", "must be an object")
    request = Request(text=text, k=_optional_int(body, "k", low=1), token_budget=_optional_int(body, "token_budget", low=1),
                      max_new_tokens=_optional_int(body, length, low=1, high=max_positions), stop=_stop(body),
                      recompute=_optional_int(body, "recompute", low=0, high=max_positions))
    return ParsedRequest(chat=chat, model=model, request=request, stream=stream,
                         include_usage=bool(options.get("include_usage")))


# -- responses ------------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(plan: QueryPlan, answer: Answer) -> dict:
    """OpenAI's usage; the cached prompt tokens are those whose K/V came from the store: the rebuilt prefix,
    less the tokens of it the model computed again (recompute)."""
    return {"prompt_tokens": plan.prompt_tokens, "completion_tokens": answer.completion_tokens,
            "total_tokens": plan.prompt_tokens + answer.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": plan.prefix_tokens - len(plan.recompute)}}


def milo_details(answer: Answer) -> dict:
    """What the store did for this answer: the retrieved groups and blocks, KV bytes, stage seconds."""
    return {"groups": list(answer.groups), "blocks": list(answer.blocks), "prefix_tokens": answer.prefix_tokens,
            "kv_bytes_full": answer.kv_bytes_full, "kv_bytes_stored": answer.kv_bytes_stored,
            "seconds": {k: round(v, 6) for k, v in answer.seconds.items()}}


def _choice(chat: bool, text: str | None, finish_reason: str | None, *, chunk: bool, first: bool = False) -> dict:
    if not chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    if not chunk:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}
    delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def completion(parsed: ParsedRequest, plan: QueryPlan, answer: Answer) -> dict:
    """The whole response of a request that did not stream."""
    return {"id": new_id(parsed.chat), "object": "chat.completion" if parsed.chat else "text_completion",
            "created": int(time.time()), "model": parsed.model,
            "choices": [_choice(parsed.chat, answer.text, answer.finish_reason, chunk=False)],
            "usage": usage(plan, answer), "milo": milo_details(answer)}


class StreamedText:
    """What a stream sends of its answer, so that its deltas join to exactly the answer's text, which the
    engine strips: leading whitespace is never sent, trailing whitespace waits until text follows it
    (or is dropped at the end). The engine's deltas never end inside a multi-byte character."""

    def __init__(self):
        self.raw, self.sent = "", 0

    def push(self, delta: str) -> str:
        """The part of the answer to send now, given the engine's next ``delta`` (the stripped text so far
        only grows: what was sent is never taken back)."""
        self.raw += delta
        text = self.raw.strip()
        out, self.sent = text[self.sent:], len(text)
        return out


class ChunkWriter:
    """Server-Sent Events of one streamed response: ``data: {chunk}`` frames, then ``data: [DONE]``."""

    def __init__(self, parsed: ParsedRequest):
        self.parsed, self.id, self.created, self.started = parsed, new_id(parsed.chat), int(time.time()), False

    def _frame(self, payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    def chunk(self, delta: str, finish_reason: str | None = None) -> str:
        first, self.started = not self.started, True
        return self._frame({"id": self.id, "object": "chat.completion.chunk" if self.parsed.chat else "text_completion",
                            "created": self.created, "model": self.parsed.model,
                            "choices": [_choice(self.parsed.chat, delta, finish_reason, chunk=True, first=first)]})

    def usage_chunk(self, plan: QueryPlan, answer: Answer) -> str:
        """The last chunk when the client asked for usage (OpenAI's ``stream_options.include_usage``)."""
        return self._frame({"id": self.id, "object": "chat.completion.chunk" if self.parsed.chat else "text_completion",
                            "created": self.created, "model": self.parsed.model, "choices": [],
                            "usage": usage(plan, answer), "milo": milo_details(answer)})

    def error(self, error: APIError) -> str:
        return self._frame(error.body())

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
