"""The OpenAI-compatible wire format: request bodies checked into engine `Request`s, answers shaped back.

Bodies are plain JSON checked field by field (not a pydantic model), so that every bad input is
one `APIError` in OpenAI's error shape naming the field. Honoured: sampling (``temperature``, ``top_p``,
vLLM's ``top_k`` and ``min_p``, ``seed``, ``presence_penalty``, ``frequency_penalty``; greedy unless a
temperature above 0 is asked), log probabilities (completions' ``logprobs: N``, chat's ``logprobs`` and
``top_logprobs``: the model's own, as vLLM reports them), ``n`` answers from one retrieval, structured output
(``response_format`` ``json_schema`` or ``json_object``; vLLM's ``guided_choice`` and ``structured_outputs``
``choice``/``json``), and a chat's system message and earlier turns (`Request.system`, ``turns``). The API is
honest: any other field of OpenAI's completions or chat schema that would change the answer (`UNHONOURED`: tools,
logit biases, echo, ...) is a 400 naming it unless its value asks for nothing (``tools: []``); fields that change
nothing (``user``, ``metadata``, ...) are accepted and ignored, as clients send them.
"""
import json
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from ..runtime.interface import Answer
from ..runtime.planning import QueryPlan, Request
from ..runtime.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprob

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_N = 16  # answers to one request at most: each is a row of a batch
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1 - MAX_N)  # answer i of n is seeded seed + i (`SamplingParams.sample`)


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
    n: int = 1  # answers asked for, each its own row

    @property
    def logprobs(self) -> bool:
        return self.request.sampling.logprobs is not None


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


def _optional_number(body: dict, name: str, low: float, high: float, *, above_low: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(name, f"must be a number, got {value!r}")
    if not (low < value <= high if above_low else low <= value <= high):
        raise invalid(name, f"must be {'above' if above_low else 'at least'} {low} and at most {high}, got {value}")
    return float(value)


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
    ("best_of", _is(1), "only best_of=1 is supported (n answers are honoured: ask for n)"),
    ("logit_bias", _empty, "logit biases are not supported"),
    ("echo", _off, "echoing the prompt is not supported"),
    ("suffix", _empty, "a suffix (insertion) is not supported"),
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


def _messages(body: dict) -> tuple[str, str | None, tuple[tuple[str, str], ...]]:
    """A chat's query (its last user message), its system message (first, if any; OpenAI's "developer" role is
    one) and its earlier (user, assistant) turns, which must alternate."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise invalid("messages", "must be a non-empty list of {role, content} objects")
    system = None
    if messages[0].get("role") in ("system", "developer"):
        system, messages = _text(messages[0].get("content"), "messages[0].content"), messages[1:]
    roles = [m.get("role") for m in messages]
    expected = ["user", "assistant"] * (len(messages) // 2) + ["user"]
    if roles != expected[:len(messages)] or len(messages) % 2 == 0:
        raise invalid("messages", f"must be an optional system message, then user and assistant turns in turn, "
                                  f"ending with the user's query; got roles {[*(['system'] if system else []), *roles]}")
    texts = [_text(m.get("content"), f"messages[{i + (system is not None)}].content") for i, m in enumerate(messages)]
    return texts[-1], system, tuple(zip(texts[:-1:2], texts[1::2]))


def _sampling(body: dict, chat: bool) -> SamplingParams:
    """The sampling fields (vLLM's ``top_k`` and ``min_p`` among them) and the log probabilities asked for."""
    top_k = _optional_int(body, "top_k", low=-1)
    if chat:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise invalid("logprobs", f"must be true or false in a chat, got {wanted!r}")
        top = _optional_int(body, "top_logprobs", low=0, high=MAX_LOGPROBS)
        if top and not wanted:
            raise invalid("top_logprobs", "needs logprobs: true")
        logprobs = (top or 0) if wanted else None
    else:
        logprobs = _optional_int(body, "logprobs", low=0, high=MAX_LOGPROBS)
    values = {"temperature": _optional_number(body, "temperature", 0, 2),
              "top_p": _optional_number(body, "top_p", 0, 1, above_low=True),
              "top_k": None if top_k is None else max(top_k, 0),  # vLLM's -1: every token
              "min_p": _optional_number(body, "min_p", 0, 1),
              "seed": _optional_int(body, "seed", low=SEED_RANGE[0], high=SEED_RANGE[1]),
              "presence_penalty": _optional_number(body, "presence_penalty", -2, 2),
              "frequency_penalty": _optional_number(body, "frequency_penalty", -2, 2)}
    return SamplingParams(logprobs=logprobs, **{k: v for k, v in values.items() if v is not None})


def _schema(value, name: str) -> str:
    if not isinstance(value, dict):
        raise invalid(name, f"must be a JSON schema object, got {type(value).__name__}")
    return json.dumps(value)


def _choices(value, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c.strip() for c in value):
        raise invalid(name, "must be a non-empty list of non-blank strings")
    return tuple(value)


def _form(body: dict) -> tuple[str | None, tuple[str, ...]]:
    """The answer's form: a JSON schema (``response_format`` json_schema or json_object; vLLM's
    ``structured_outputs.json``) or strings it is one of (vLLM's ``guided_choice``, ``structured_outputs.choice``)."""
    forms = []
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            forms.append(('{"type": "object"}', ()))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise invalid("response_format", "json_schema must be an object holding the schema under 'schema'")
            forms.append((_schema(spec["schema"], "response_format.json_schema.schema"), ()))
        else:
            raise invalid("response_format", f"must be of type text, json_schema or json_object, got {kind!r}")
    if body.get("guided_choice") is not None:
        forms.append((None, _choices(body["guided_choice"], "guided_choice")))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict) or len(outputs) != 1 or next(iter(outputs)) not in ("choice", "json"):
            raise invalid("structured_outputs", "must hold exactly one of 'choice' (a list of strings) or 'json' "
                                                "(a JSON schema)")
        forms.append((_schema(outputs["json"], "structured_outputs.json"), ()) if "json" in outputs
                     else (None, _choices(outputs["choice"], "structured_outputs.choice")))
    if len(forms) > 1:
        raise invalid("response_format", "one form of structured output at a time")
    return forms[0] if forms else (None, ())


def parse_request(body: dict, *, chat: bool, models, max_positions: int) -> ParsedRequest:
    """Check a completions (``chat`` False) or chat-completions body against the mounted ``models``."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "is required: the name of a mounted store (GET /v1/models lists them)")
    if model not in models:
        raise APIError(404, f"model {model!r} is not mounted here; mounted: {', '.join(sorted(models))}",
                       param="model", code="model_not_found")
    _check_honoured(body)
    text, system, turns = _messages(body) if chat else (_text(body.get("prompt"), "prompt"), None, ())
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
    try:
        sampling = _sampling(body, chat)
    except ValueError as e:  # a combination SamplingParams refuses
        raise APIError(400, str(e), code="invalid_value") from None
    schema, choices = _form(body)
    request = Request(text=text, k=_optional_int(body, "k", low=1), token_budget=_optional_int(body, "token_budget", low=1),
                      max_new_tokens=_optional_int(body, length, low=1, high=max_positions), stop=_stop(body),
                      recompute=_optional_int(body, "recompute", low=0, high=max_positions), sampling=sampling,
                      schema=schema, choices=choices, system=system, turns=turns)
    return ParsedRequest(chat=chat, model=model, request=request, stream=stream,
                         include_usage=bool(options.get("include_usage")), n=_optional_int(body, "n", low=1, high=MAX_N) or 1)


# -- responses ------------------------------------------------------------------------------------
def label_format(labels) -> dict:
    """The ``response_format`` that holds an answer to one of ``labels``, as a JSON string."""
    return {"type": "json_schema", "json_schema": {"name": "label", "strict": True,
                                                   "schema": {"type": "string", "enum": list(labels)}}}


def store_card(mounted) -> dict:
    """What /v1/models says of a mounted store beyond its name: its system prompt (None: built without one) and, for
    a label store, its labels and their `label_format`."""
    queries = getattr(mounted, "queries", None)
    if queries is None:  # an engine whose stores are not mounted here
        return {}
    task = queries.task
    card = {"system_prompt": task.system or None}
    if task.labels:
        card.update(labels=list(task.labels), response_format=label_format(task.labels))
    return card


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(plan: QueryPlan, answers: list[Answer]) -> dict:
    """OpenAI's usage: the prompt once, every answer's tokens; the cached prompt tokens are those whose K/V came from
    the store: the rebuilt prefix, less the tokens of it the model computed again (recompute)."""
    completion_tokens = sum(a.completion_tokens for a in answers)
    return {"prompt_tokens": plan.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": plan.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": plan.prefix_tokens - len(plan.recompute)}}


def milo_details(answer: Answer) -> dict:
    """What the store did for this answer: the retrieved groups and blocks, KV bytes, stage seconds."""
    return {"groups": list(answer.groups), "blocks": list(answer.blocks), "prefix_tokens": answer.prefix_tokens,
            "kv_bytes_full": answer.kv_bytes_full, "kv_bytes_stored": answer.kv_bytes_stored,
            "seconds": {k: round(v, 6) for k, v in answer.seconds.items()}}


@lru_cache(maxsize=65536)
def token_text(tokenizer, token: int) -> str:
    """A token as a log probability names it: its text alone (a piece of a character's bytes reads as U+FFFD)."""
    return tokenizer.decode([token])


class Logprobs:
    """Log probabilities in the wire's two shapes, from `TokenLogprob`s: chat's ``{"content": [...]}`` and
    completions' ``{tokens, token_logprobs, top_logprobs, text_offset}`` (whose top entries hold the chosen token
    too, as OpenAI's legacy API; offsets count from the answer's start across a stream's chunks)."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat, self.offset = tokenizer, chat, 0

    def shape(self, entries: list[TokenLogprob]) -> dict:
        if self.chat:
            return {"content": [{**self._token(e.token, e.logprob),
                                 "top_logprobs": [self._token(t, lp) for t, lp in e.top]} for e in entries]}
        texts = [token_text(self.tokenizer, e.token) for e in entries]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{**{token_text(self.tokenizer, t): lp for t, lp in e.top}, text: e.logprob}
                                 for e, text in zip(entries, texts)], "text_offset": offsets}

    def _token(self, token: int, logprob: float) -> dict:
        text = token_text(self.tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _choice(chat: bool, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None, *,
            chunk: bool, first: bool = False) -> dict:
    if not chat:
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    if not chunk:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}
    delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def completion(parsed: ParsedRequest, plan: QueryPlan, answers: list[Answer], tokenizer=None) -> dict:
    """The whole response of a request that did not stream: one choice per answer."""
    shaped = [Logprobs(tokenizer, parsed.chat).shape(a.logprobs) if parsed.logprobs else None for a in answers]
    return {"id": new_id(parsed.chat), "object": "chat.completion" if parsed.chat else "text_completion",
            "created": int(time.time()), "model": parsed.model,
            "choices": [_choice(parsed.chat, i, a.text, a.finish_reason, shaped[i], chunk=False)
                        for i, a in enumerate(answers)],
            "usage": usage(plan, answers), "milo": milo_details(answers[0])}


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
    """Server-Sent Events of one streamed response: ``data: {chunk}`` frames, then ``data: [DONE]``. Each of its n
    answers (``index``) has its own text and log probabilities; a token's log probability goes out with the first
    chunk that carries text at or after it."""

    def __init__(self, parsed: ParsedRequest, tokenizer=None):
        self.parsed, self.id, self.created = parsed, new_id(parsed.chat), int(time.time())
        self.texts = [StreamedText() for _ in range(parsed.n)]
        self.logprobs = [Logprobs(tokenizer, parsed.chat) for _ in range(parsed.n)]
        self.pending: list[list[TokenLogprob]] = [[] for _ in range(parsed.n)]
        self.started = [False] * parsed.n

    def _frame(self, payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    def event(self, index: int, delta: str, finish_reason: str | None = None,
              logprobs: list[TokenLogprob] | None = None) -> str | None:
        """The frame of answer ``index``'s next engine event (None: nothing to send yet)."""
        text = self.texts[index].push(delta)
        self.pending[index] += logprobs or []
        if not (text or finish_reason or not self.started[index]):
            return None
        first, self.started[index] = not self.started[index], True
        shaped = None
        if self.parsed.logprobs and (text or finish_reason):
            shaped, self.pending[index] = self.logprobs[index].shape(self.pending[index]), []
        return self._frame({"id": self.id, "object": "chat.completion.chunk" if self.parsed.chat else "text_completion",
                            "created": self.created, "model": self.parsed.model,
                            "choices": [_choice(self.parsed.chat, index, text, finish_reason, shaped, chunk=True,
                                                first=first)]})

    def usage_chunk(self, plan: QueryPlan, answers: list[Answer]) -> str:
        """The last chunk when the client asked for usage (OpenAI's ``stream_options.include_usage``)."""
        return self._frame({"id": self.id, "object": "chat.completion.chunk" if self.parsed.chat else "text_completion",
                            "created": self.created, "model": self.parsed.model, "choices": [],
                            "usage": usage(plan, answers), "milo": milo_details(answers[0])})

    def error(self, error: APIError) -> str:
        return self._frame(error.body())

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
