"""The OpenAI-compatible wire format: request bodies checked into engine `Request`s, answers shaped back.

Bodies are plain JSON checked field by field (not a pydantic model), so that every bad input is one `APIError` in
OpenAI's error shape naming the field. Every field of OpenAI's completions and chat schemas and of vLLM's
(its `SamplingParams` extras and structured output, old and new forms) is one of three:

- honoured: sampling (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``presence_penalty``,
  ``frequency_penalty``, ``repetition_penalty``; greedy unless a temperature above 0 is asked), where the answer
  ends (``max_tokens``/``max_completion_tokens``, ``stop``, ``stop_token_ids``, ``min_tokens``, ``ignore_eos``,
  ``include_stop_str_in_output``, ``skip_special_tokens``: `decoding.Ending`), log probabilities (completions'
  ``logprobs: N``, chat's ``logprobs`` and ``top_logprobs``: the model's own, as vLLM reports them), ``n`` answers
  from one retrieval, structured output (`_form`: ``response_format`` json_schema/json_object; vLLM's
  ``guided_json``, ``guided_regex``, ``guided_grammar`` (EBNF), ``guided_choice``, ``guided_json_object`` and
  ``structured_outputs``' json/regex/grammar/choice/json_object), a chat's system message and earlier turns,
  ``stream``/``stream_options``, vLLM's ``request_id`` (the answer's id) and milo's own ``k``, ``token_budget``,
  ``recompute``;
- refused with a 400 naming it when its value asks for anything (`UNHONOURED`: tools, logit biases, echo, beam
  search, prompt log probabilities, chat templates, ...; ``tools: []`` asks for nothing);
- changing nothing here, accepted (`INERT`: ``user``, ``metadata``, ``store``, ``session_id``, ...).

A field no API names is ignored, as OpenAI's clients may add new ones (vLLM, whose models allow extra fields, does
the same).
"""
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from ..runtime.decoding import Ending
from ..runtime.interface import Answer
from ..runtime.planning import QueryPlan, Request
from ..runtime.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprob

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_N = 16  # answers to one request at most: each is a row of a batch
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1 - MAX_N)  # answer i of n is seeded seed + i (`SamplingParams.sample`)
log = logging.getLogger("milo.serve")


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
    request_id: str | None = None  # the client's (vLLM's field): the answer's id is made of it

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


def _optional_bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise invalid(name, f"must be true or false, got {value!r}")
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


def _absent(value) -> bool:
    return value is None


def _default(*values) -> Callable[[object], bool]:
    """Whether a field's value is absent or one of ``values`` (its default: asks for nothing)."""
    return lambda v: v is None or any(v == d and type(v) is type(d) for d in values)


NO_BEAM = "beam search is not supported"
NO_PROMPT_CONTROL = "the prompt is the store's template around the retrieved demonstrations"
# Fields of OpenAI's and vLLM's completions and chat schemas that would change the answer and that milo does not
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
    ("thinking_token_budget", _default(-1), "the model does not reason: a thinking budget cannot be honoured"),
    ("verbosity", _empty, "answers are not shaped by verbosity"),
    ("web_search_options", _empty, "web search is not supported"),
    ("use_beam_search", _off, NO_BEAM),
    ("early_stopping", _off, NO_BEAM),
    ("length_penalty", _is(1), f"length_penalty scores beams: {NO_BEAM}"),
    ("watermarking", _off, "watermarking is not supported"),
    ("allowed_token_ids", _empty, "a list of allowed tokens is not supported (structured output is: guided_regex)"),
    ("bad_words", _empty, "bad words are not supported"),
    ("logits_processors", _empty, "logits processors are not supported"),
    ("repetition_detection", _empty, "repetition detection is not supported"),
    ("spaces_between_special_tokens", _default(True), "special tokens' text is joined as the tokenizer decodes it"),
    ("prompt_logprobs", _absent, "the prompt's log probabilities are not reported (its K/V come from the store)"),
    ("logprob_token_ids", _empty, "log probabilities of chosen token ids are not supported (ask logprobs)"),
    ("return_tokens_as_token_ids", _off, "log probabilities name tokens by their text"),
    ("return_token_ids", _off, "token ids are not returned"),
    ("return_token_offsets", _off, "token offsets are not returned"),
    ("return_prompt_text", _off, "the prompt's text is not returned"),
    ("routed_experts_prompt_start", _is(0), "routed-expert data is not returned"),
    ("truncate_prompt_tokens", _absent, f"prompts are not truncated: {NO_PROMPT_CONTROL}"),
    ("truncation_side", _absent, f"prompts are not truncated: {NO_PROMPT_CONTROL}"),
    ("add_special_tokens", _absent, f"{NO_PROMPT_CONTROL}, whose anchor holds its special tokens"),
    ("add_generation_prompt", _default(True), NO_PROMPT_CONTROL),
    ("continue_final_message", _off, f"{NO_PROMPT_CONTROL}: the last message is a user's query"),
    ("chat_template", _empty, NO_PROMPT_CONTROL),
    ("chat_template_kwargs", _empty, NO_PROMPT_CONTROL),
    ("documents", _empty, f"{NO_PROMPT_CONTROL}: its documents are the store's"),
    ("prompt_embeds", _empty, "prompt embeddings are not supported"),
    ("mm_processor_kwargs", _empty, "multimodal input is not supported"),
    ("media_io_kwargs", _empty, "multimodal input is not supported"),
    ("mm_payload", _default("tensors"), "multimodal input is not supported"),
    ("return_mm_kwargs", _off, "multimodal input is not supported"),
    ("priority", _is(0), "requests are answered first come, first served"),
    ("stream_interval", _is(1), "a stream sends each token's text as it comes"),
    ("cache_salt", _empty, "the prefix comes from the store, the same for every request"),
    ("kv_transfer_params", _empty, "KV transfer is milo's own: its K/V come from the store"),
    ("ec_transfer_params", _empty, "encoder-cache transfer is not supported"),
    ("vllm_xargs", _empty, "extension arguments are not supported"),
    ("guided_whitespace_pattern", _empty, "JSON is always compact: a whitespace pattern is not supported"),
    ("structural_tag", _empty, "structural tags are not supported (guided_json, guided_regex, guided_grammar are)"),
)
# Fields that change nothing milo answers (accepted, as clients send them): who asks, what to store or bill, how a
# router groups requests, OpenAI's latency hint, a reasoning model's switch.
INERT = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier",
         "prediction", "include_reasoning", "session_id")


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
    """The sampling fields (vLLM's ``top_k``, ``min_p`` and ``repetition_penalty`` among them) and the log
    probabilities asked for."""
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
              "frequency_penalty": _optional_number(body, "frequency_penalty", -2, 2),
              "repetition_penalty": _optional_number(body, "repetition_penalty", 0, 2, above_low=True)}
    return SamplingParams(logprobs=logprobs, **{k: v for k, v in values.items() if v is not None})


def _ending(body: dict, max_tokens: int | None) -> Ending:
    """Where a free-form answer ends besides ``stop`` and its budget: vLLM's fields of `Ending`."""
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (isinstance(stop_ids, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids)):
        raise invalid("stop_token_ids", f"must be a list of token ids (integers, 0 or more), got {stop_ids!r}")
    min_tokens = _optional_int(body, "min_tokens", low=0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid("min_tokens", f"must be at most max_tokens ({max_tokens}), got {min_tokens}")
    skip = _optional_bool(body, "skip_special_tokens")
    return Ending(stop_token_ids=tuple(stop_ids or ()), min_tokens=min_tokens,
                  ignore_eos=bool(_optional_bool(body, "ignore_eos")),
                  include_stop=bool(_optional_bool(body, "include_stop_str_in_output")),
                  skip_special_tokens=True if skip is None else skip)


def _schema(value, name: str) -> str:
    """A JSON schema's text, from an object or from JSON text of one (vLLM takes either)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise invalid(name, f"is not JSON text of a schema: {e}") from None
    if not isinstance(value, dict):
        raise invalid(name, f"must be a JSON schema object, got {type(value).__name__}")
    return json.dumps(value)


def _source(value, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(name, f"must be a non-empty string, got {value!r}")
    return value


def _choices(value, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c.strip() for c in value):
        raise invalid(name, "must be a non-empty list of non-blank strings")
    return tuple(value)


Form = tuple[tuple[str, str] | None, tuple[str, ...]]  # a grammar (kind, source) or the strings the answer is one of
JSON_OBJECT = ("json", '{"type": "object"}')


def _guided(name: str, kind: str, value) -> Form | None:
    """The form of one structured-output field ``name``, of ``kind`` (`STRUCTURED_FORMS`)."""
    if kind == "json_object":
        if not isinstance(value, bool):
            raise invalid(name, f"must be true or false, got {value!r}")
        return (JSON_OBJECT, ()) if value else None
    if kind == "choice":
        return None, _choices(value, name)
    if kind == "json":
        return ("json", _schema(value, name)), ()
    return ("regex" if kind == "regex" else "ebnf", _source(value, name)), ()


STRUCTURED_FORMS = ("json", "regex", "grammar", "choice", "json_object")  # structured_outputs' (EBNF grammar)
GUIDED = tuple(f"guided_{kind}" for kind in STRUCTURED_FORMS)  # vLLM's older fields of the same forms
# structured_outputs' options milo's grammar keeps whatever they say: its JSON is always compact (no whitespace
# asked or allowed) and strict (no property a schema does not name)
STRUCTURED_OPTIONS = ("disable_any_whitespace", "disable_additional_properties")


def _structured_outputs(outputs) -> Form | None:
    """vLLM's ``structured_outputs`` object: exactly one form, and options milo's grammar honours."""
    if not isinstance(outputs, dict):
        raise invalid("structured_outputs", f"must be an object, got {type(outputs).__name__}")
    for key, value in outputs.items():
        if key in STRUCTURED_OPTIONS and value is not None and not isinstance(value, bool):
            raise invalid(f"structured_outputs.{key}", f"must be true or false, got {value!r}")
        if key not in STRUCTURED_FORMS + STRUCTURED_OPTIONS and value is not None:
            raise invalid(f"structured_outputs.{key}", f"is not supported (milo takes one of "
                                                       f"{', '.join(STRUCTURED_FORMS)})")
    forms = [k for k in STRUCTURED_FORMS if outputs.get(k) is not None]
    if len(forms) != 1:
        raise invalid("structured_outputs", f"must hold exactly one of {', '.join(STRUCTURED_FORMS)}, got "
                                            f"{forms or 'none'}")
    return _guided(f"structured_outputs.{forms[0]}", forms[0], outputs[forms[0]])


def _form(body: dict) -> Form:
    """The answer's form: a grammar (``response_format`` json_schema or json_object, vLLM's guided fields and
    ``structured_outputs``) or strings it is one of (``guided_choice``, ``structured_outputs.choice``)."""
    forms = []
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            forms.append((JSON_OBJECT, ()))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise invalid("response_format", "json_schema must be an object holding the schema under 'schema'")
            forms.append((("json", _schema(spec["schema"], "response_format.json_schema.schema")), ()))
        else:
            raise invalid("response_format", f"must be of type text, json_schema or json_object, got {kind!r}")
    forms += [_guided(name, name.removeprefix("guided_"), body[name]) for name in GUIDED if body.get(name) is not None]
    if body.get("structured_outputs") is not None:
        forms.append(_structured_outputs(body["structured_outputs"]))
    backend = body.get("guided_decoding_backend")
    if backend not in (None, "auto", "xgrammar"):
        raise invalid("guided_decoding_backend", f"milo's structured output is xgrammar's, got {backend!r}")
    forms = [f for f in forms if f is not None]
    if len(forms) > 1:
        raise invalid("response_format", "one form of structured output at a time")
    return forms[0] if forms else (None, ())


# Fields parse_request reads (besides UNHONOURED's, refused when they ask for anything, and INERT's).
HONOURED = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
            "stop", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "logprobs", "top_logprobs", "stop_token_ids", "min_tokens", "ignore_eos",
            "include_stop_str_in_output", "skip_special_tokens", "response_format", *GUIDED,
            "guided_decoding_backend", "structured_outputs", "request_id", "k", "token_budget", "recompute")
KNOWN = frozenset(HONOURED + INERT + tuple(name for name, _, _ in UNHONOURED))


def parse_request(body: dict, *, chat: bool, models, max_positions: int) -> ParsedRequest:
    """Check a completions (``chat`` False) or chat-completions body against the mounted ``models``; a field no API
    names is logged, once per request, and otherwise ignored."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "is required: the name of a mounted store (GET /v1/models lists them)")
    if model not in models:
        raise APIError(404, f"model {model!r} is not mounted here; mounted: {', '.join(sorted(models))}",
                       param="model", code="model_not_found")
    _check_honoured(body)
    if unknown := sorted(set(body) - KNOWN):
        log.warning("request fields no API of milo's names, ignored: %s", ", ".join(map(repr, unknown)))
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
    if options.get("continuous_usage_stats"):
        raise invalid("stream_options", "continuous_usage_stats is not supported (include_usage is)")
    try:
        sampling = _sampling(body, chat)
    except ValueError as e:  # a combination SamplingParams refuses
        raise APIError(400, str(e), code="invalid_value") from None
    grammar, choices = _form(body)
    max_new_tokens = _optional_int(body, length, low=1, high=max_positions)
    request_id = body.get("request_id")
    if request_id is not None and not (isinstance(request_id, str) and request_id):
        raise invalid("request_id", f"must be a non-empty string, got {request_id!r}")
    request = Request(text=text, k=_optional_int(body, "k", low=1), token_budget=_optional_int(body, "token_budget", low=1),
                      max_new_tokens=max_new_tokens, stop=_stop(body), ending=_ending(body, max_new_tokens),
                      recompute=_optional_int(body, "recompute", low=0, high=max_positions), sampling=sampling,
                      grammar=grammar, choices=choices, system=system, turns=turns)
    return ParsedRequest(chat=chat, model=model, request=request, stream=stream,
                         include_usage=bool(options.get("include_usage")), n=_optional_int(body, "n", low=1, high=MAX_N) or 1,
                         request_id=request_id)


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


def new_id(parsed: ParsedRequest) -> str:
    """The answer's id: made of the client's ``request_id`` where it sent one (as vLLM's), else random."""
    return ("chatcmpl-" if parsed.chat else "cmpl-") + (parsed.request_id or uuid.uuid4().hex)


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


BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece vocabulary's piece of one raw byte


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) printable stand-in for each byte, to that byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


@lru_cache(maxsize=65536)
def token_bytes(tokenizer, token: int) -> list[int]:
    """A token's own bytes, as a log probability's ``bytes`` gives them: its text's UTF-8 where it decodes whole,
    else (a piece of a character, which decodes to U+FFFD) the byte a byte-fallback piece names (``<0xE2>``: 226)
    or the bytes a byte-level piece stands for."""
    text = token_text(tokenizer, token)
    if "\ufffd" in text:
        piece = tokenizer.convert_ids_to_tokens(token)
        if match := BYTE_FALLBACK.fullmatch(piece):
            return [int(match[1], 16)]
        alphabet = _byte_level_alphabet()
        if piece and all(c in alphabet for c in piece):
            return [alphabet[c] for c in piece]
    return list(text.encode("utf-8"))


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
        return {"token": token_text(self.tokenizer, token), "logprob": logprob,
                "bytes": token_bytes(self.tokenizer, token)}


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
    return {"id": new_id(parsed), "object": "chat.completion" if parsed.chat else "text_completion",
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
        self.parsed, self.id, self.created = parsed, new_id(parsed), int(time.time())
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
