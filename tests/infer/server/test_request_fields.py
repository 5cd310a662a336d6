"""Every field of OpenAI's and vLLM's completions and chat requests, sent to `milo serve` over its real engine: each
is honoured (the answer holds to it), changes nothing milo answers, or is refused with a 400 naming it; none is
accepted and ignored (issue 71). A random tiny Qwen2 (byte tokenizer) over an identity store of a free-form task, in
process. The served tokenizer's eos is a token the model says early (its sixth greedy token, from a reference run),
so that where an answer ends, and what ends it, can be seen."""
import dataclasses
import json
import re

import httpx
import pytest

from milo_infer.bench.synthetic_model import byte_tokenizer
from milo_infer.building.builder import BuildConfig, build_store
from milo_infer.models import LoadedModel
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.planning import Request
from milo_infer.runtime.sampling import SamplingParams, TokenLogprob
from milo_infer.server.protocol import Logprobs
from milo_infer.tasks.corpus import load_corpus, task_from_corpus
from milo_store import CompressionConfig, MiloStore

from tests.infer.demo_stores import DEMO
from tests.infer.runtime.test_engine import random_qwen2
from tests.infer.server.serving import serving

PROMPT = "where is my card"
LONG = 24  # the budget of the cases whose answers run on


@dataclasses.dataclass
class Served:
    base: str
    greedy: list[int]  # the served model's greedy answer's tokens (ending with its eos)
    tokenizer: object

    def text(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    loaded = random_qwen2()
    demos = load_corpus(DEMO)[:8]
    task = dataclasses.replace(task_from_corpus(demos), answer_kind="number", labels=())  # free-form answers
    config = BuildConfig(block_size=4, context_blocks=0, order="corpus",
                         compression=CompressionConfig(ratio=1.0, codec="identity", dtype="float32"))
    root = tmp_path_factory.mktemp("fields")
    build_store(root / "s", loaded, demos, task, config, progress=False)
    with MiloStore.open(root / "s") as store:
        reference = Engine(loaded, {"s": store})
        answer = reference.answer([reference.plan("s", Request(PROMPT, max_new_tokens=LONG,
                                                               sampling=SamplingParams(logprobs=0)))])[0]
        said = [e.token for e in answer.logprobs]
        assert len(set(said[:6])) == 6, said  # its sixth token is new there: as eos, it ends the answer there
        tokenizer = byte_tokenizer()
        tokenizer.add_special_tokens({"eos_token": tokenizer.convert_ids_to_tokens(said[5])})
        engine = Engine(LoadedModel(loaded.model, tokenizer, loaded.identity), {"s": store})
        with serving(engine, max_batch=4) as server:
            yield Served(server.base, said[:6], tokenizer)


def ask(served: Served, api: str, fields: dict) -> httpx.Response:
    base = {"model": "s", "max_tokens": LONG}
    base.update({"messages": [{"role": "user", "content": PROMPT}]} if api == "chat" else {"prompt": PROMPT})
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    return httpx.post(served.base + path, json={**base, **fields}, timeout=60)


def answer_of(reply: httpx.Response, api: str) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) of a 200 reply, streamed or not (tokens None: a stream that did not
    ask for usage)."""
    assert reply.status_code == 200, reply.text
    if reply.headers["content-type"].startswith("text/event-stream"):
        chunks = [json.loads(f.removeprefix("data: ")) for f in reply.text.split("\n\n") if f and f != "data: [DONE]"]
        pieces = [c["choices"][0] for c in chunks if c["choices"]]
        text = "".join((p["delta"].get("content") or "") if api == "chat" else p["text"] for p in pieces)
        return text, (chunks[-1].get("usage") or {}).get("completion_tokens"), pieces[-1]["finish_reason"]
    body = reply.json()
    choice = body["choices"][0]
    return (choice["message"]["content"] if api == "chat" else choice["text"], body["usage"]["completion_tokens"],
            choice["finish_reason"])


# -- what each honoured field's answer must hold to ----------------------------------------------------------------
def greedy(s, api, fields):
    text, tokens, reason = answer_of(ask(s, api, fields), api)
    assert (text, reason) == (s.text(s.greedy), "stop") and tokens in (len(s.greedy), None)


def sampled(s, api, fields):  # a hot temperature answers otherwise than greedy, and a seed repeats it
    first = answer_of(ask(s, api, fields), api)
    assert first[0] != s.text(s.greedy) and answer_of(ask(s, api, fields), api) == first


def budget(s, api, fields):
    assert answer_of(ask(s, api, fields), api)[1:] == (3, "length")


def n_answers(s, api, fields):
    assert len(ask(s, api, fields).json()["choices"]) == fields["n"]


def usage_last(s, api, fields):
    assert answer_of(ask(s, api, fields), api)[1] == len(s.greedy)


def cut_at_stop(s, api, fields):
    stop = s.text(s.greedy[2:3])
    text, _, reason = answer_of(ask(s, api, {**fields, "stop": [stop]}), api)
    kept = len(stop) if fields.get("include_stop_str_in_output") else 0
    full = s.text(s.greedy)
    assert (text, reason) == (full[:full.index(stop) + kept].strip(), "stop")


def at_stop_token(s, api, fields):
    text, tokens, reason = answer_of(ask(s, api, {"stop_token_ids": [s.greedy[2]]}), api)
    assert (text, tokens, reason) == (s.text(s.greedy[:2]), 3, "stop")


def past_eos(s, api, fields):
    assert answer_of(ask(s, api, fields), api)[1:] == (LONG, "length")


def at_least(s, api, fields):
    assert answer_of(ask(s, api, fields), api)[1] >= fields["min_tokens"]


def penalised(s, api, fields):  # the model's greedy loop (its tokens again and again) is broken by the penalty
    loop = answer_of(ask(s, api, {"ignore_eos": True}), api)
    text, tokens, _ = answer_of(ask(s, api, {**fields, "ignore_eos": True}), api)
    assert tokens == LONG and text != loop[0]


def special_text(s, api, fields):
    text = answer_of(ask(s, api, {**fields, "ignore_eos": True}), api)[0]
    assert s.tokenizer.eos_token in text


def own_bytes(s, api, fields):
    body = ask(s, api, fields).json()
    if api == "chat":
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == len(s.greedy)
        assert all(len(c["bytes"]) == 1 for c in content)  # a byte tokenizer's token is its one byte, never U+FFFD's
        assert all(len(c["top_logprobs"]) == fields.get("top_logprobs", 0) for c in content)
    else:
        assert len(body["choices"][0]["logprobs"]["tokens"]) == len(s.greedy)


def matches(pattern):
    def check(s, api, fields):
        text = answer_of(ask(s, api, fields), api)[0]
        assert re.fullmatch(pattern, text), text
    return check


def json_of(kind):
    def check(s, api, fields):
        value = json.loads(answer_of(ask(s, api, fields), api)[0])
        assert value in ENUM if kind == "enum" else isinstance(value, dict)
    return check


def one_of(choices):
    def check(s, api, fields):
        assert answer_of(ask(s, api, fields), api)[0] in choices
    return check


def named_id(s, api, fields):
    assert ask(s, api, fields).json()["id"].endswith(fields["request_id"])


def retrieved_k(s, api, fields):
    assert len(ask(s, api, fields).json()["milo"]["groups"]) == fields["k"]


def fewer_cached(s, api, fields):
    cached = ask(s, api, {}).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert ask(s, api, fields).json()["usage"]["prompt_tokens_details"]["cached_tokens"] < cached


def refused(s, api, fields):
    (name,) = fields
    reply = ask(s, api, fields)
    assert reply.status_code == 400, f"{name} was accepted: {reply.text[:300]}"
    error = reply.json()["error"]
    assert error["param"] == name and name in error["message"]


ENUM = ["ab", "cd"]
SCHEMA = {"type": "string", "enum": ENUM}
HOT = {"temperature": 2.0, "seed": 11}
BOTH, COMPLETIONS, CHAT = ("completions", "chat"), ("completions",), ("chat",)
# (field, the APIs that name it, the fields sent with the request (the field's own value first), what must hold).
# OpenAI's completions and chat fields, then vLLM's extras (its SamplingParams and structured output, the older
# guided_* forms too), then milo's own.
FIELDS = [
    ("model", BOTH, {"model": "s"}, greedy),
    ("prompt", COMPLETIONS, {"prompt": PROMPT}, greedy),
    ("messages", CHAT, {"messages": [{"role": "user", "content": PROMPT}]}, greedy),
    ("best_of", COMPLETIONS, {"best_of": 2}, refused),
    ("echo", BOTH, {"echo": True}, refused),
    ("frequency_penalty", BOTH, {"frequency_penalty": 2.0}, penalised),
    ("logit_bias", BOTH, {"logit_bias": {"5": 10}}, refused),
    ("logprobs", COMPLETIONS, {"logprobs": 2}, own_bytes),
    ("logprobs", CHAT, {"logprobs": True}, own_bytes),
    ("top_logprobs", CHAT, {"top_logprobs": 3, "logprobs": True}, own_bytes),
    ("max_tokens", BOTH, {"max_tokens": 3}, budget),
    ("max_completion_tokens", CHAT, {"max_completion_tokens": 3}, budget),
    ("n", BOTH, {"n": 2}, n_answers),
    ("presence_penalty", BOTH, {"presence_penalty": 2.0}, penalised),
    ("seed", BOTH, {"seed": 5}, greedy),  # greedy: nothing to seed
    ("stop", BOTH, {}, cut_at_stop),
    ("stream", BOTH, {"stream": True}, greedy),
    ("stream_options", BOTH, {"stream_options": {"include_usage": True}, "stream": True}, usage_last),
    ("suffix", COMPLETIONS, {"suffix": "!"}, refused),
    ("temperature", BOTH, HOT, sampled),
    ("top_p", BOTH, {"top_p": 1e-6, **HOT}, greedy),
    ("user", BOTH, {"user": "someone"}, greedy),
    ("audio", CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, refused),
    ("function_call", CHAT, {"function_call": "auto"}, refused),
    ("functions", CHAT, {"functions": [{"name": "f"}]}, refused),
    ("metadata", CHAT, {"metadata": {"team": "a"}}, greedy),
    ("modalities", CHAT, {"modalities": ["text", "audio"]}, refused),
    ("parallel_tool_calls", CHAT, {"parallel_tool_calls": True}, greedy),
    ("prediction", CHAT, {"prediction": {"type": "content", "content": "x"}}, greedy),
    ("prompt_cache_key", CHAT, {"prompt_cache_key": "k"}, greedy),
    ("reasoning_effort", CHAT, {"reasoning_effort": "low"}, refused),
    ("response_format", CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                          "schema": SCHEMA}}},
     json_of("enum")),
    ("response_format", COMPLETIONS, {"response_format": {"type": "json_object"}}, json_of("object")),
    ("safety_identifier", CHAT, {"safety_identifier": "u1"}, greedy),
    ("service_tier", CHAT, {"service_tier": "auto"}, greedy),
    ("store", CHAT, {"store": True}, greedy),
    ("tool_choice", CHAT, {"tool_choice": "auto"}, refused),
    ("tools", CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, refused),
    ("verbosity", CHAT, {"verbosity": "low"}, refused),
    ("web_search_options", CHAT, {"web_search_options": {"search_context_size": "low"}}, refused),
    # vLLM's
    ("use_beam_search", BOTH, {"use_beam_search": True}, refused),
    ("top_k", BOTH, {"top_k": 1, **HOT}, greedy),
    ("min_p", BOTH, {"min_p": 1.0, **HOT}, greedy),
    ("repetition_penalty", BOTH, {"repetition_penalty": 2.0}, penalised),
    ("watermarking", BOTH, {"watermarking": True}, refused),
    ("length_penalty", BOTH, {"length_penalty": 0.5}, refused),
    ("stop_token_ids", BOTH, {}, at_stop_token),
    ("include_stop_str_in_output", BOTH, {"include_stop_str_in_output": True}, cut_at_stop),
    ("ignore_eos", BOTH, {"ignore_eos": True}, past_eos),
    ("min_tokens", BOTH, {"min_tokens": 20, "max_tokens": 32}, at_least),
    ("skip_special_tokens", BOTH, {"skip_special_tokens": False}, special_text),
    ("spaces_between_special_tokens", BOTH, {"spaces_between_special_tokens": False}, refused),
    ("truncate_prompt_tokens", BOTH, {"truncate_prompt_tokens": 8}, refused),
    ("truncation_side", BOTH, {"truncation_side": "left"}, refused),
    ("allowed_token_ids", BOTH, {"allowed_token_ids": [1, 2]}, refused),
    ("prompt_logprobs", BOTH, {"prompt_logprobs": 1}, refused),
    ("logprob_token_ids", BOTH, {"logprob_token_ids": [1]}, refused),
    ("bad_words", BOTH, {"bad_words": ["x"]}, refused),
    ("prompt_embeds", COMPLETIONS, {"prompt_embeds": "AAAA"}, refused),
    ("add_special_tokens", BOTH, {"add_special_tokens": True}, refused),
    ("structured_outputs", BOTH, {"structured_outputs": {"regex": "[a-c]{4}"}}, matches("[a-c]{4}")),
    ("priority", BOTH, {"priority": 1}, refused),
    ("request_id", BOTH, {"request_id": "abc123"}, named_id),
    ("session_id", BOTH, {"session_id": "s1"}, greedy),
    ("return_tokens_as_token_ids", BOTH, {"return_tokens_as_token_ids": True}, refused),
    ("return_token_ids", BOTH, {"return_token_ids": True}, refused),
    ("routed_experts_prompt_start", BOTH, {"routed_experts_prompt_start": 1}, refused),
    ("return_token_offsets", BOTH, {"return_token_offsets": True}, refused),
    ("mm_payload", BOTH, {"mm_payload": "none"}, refused),
    ("return_mm_kwargs", BOTH, {"return_mm_kwargs": True}, refused),
    ("cache_salt", BOTH, {"cache_salt": "salt"}, refused),
    ("kv_transfer_params", BOTH, {"kv_transfer_params": {"a": 1}}, refused),
    ("ec_transfer_params", BOTH, {"ec_transfer_params": {"a": 1}}, refused),
    ("vllm_xargs", BOTH, {"vllm_xargs": {"a": 1}}, refused),
    ("repetition_detection", BOTH, {"repetition_detection": {"n": 3}}, refused),
    ("thinking_token_budget", BOTH, {"thinking_token_budget": 10}, refused),
    ("stream_interval", BOTH, {"stream_interval": 4}, refused),
    ("include_reasoning", CHAT, {"include_reasoning": False}, greedy),
    ("add_generation_prompt", CHAT, {"add_generation_prompt": False}, refused),
    ("continue_final_message", CHAT, {"continue_final_message": True}, refused),
    ("documents", CHAT, {"documents": [{"title": "t", "text": "x"}]}, refused),
    ("chat_template", CHAT, {"chat_template": "{{ messages }}"}, refused),
    ("chat_template_kwargs", CHAT, {"chat_template_kwargs": {"enable_thinking": True}}, refused),
    ("media_io_kwargs", CHAT, {"media_io_kwargs": {"a": 1}}, refused),
    ("mm_processor_kwargs", CHAT, {"mm_processor_kwargs": {"a": 1}}, refused),
    ("return_prompt_text", CHAT, {"return_prompt_text": True}, refused),
    # vLLM's older structured-output and sampling fields
    ("guided_json", BOTH, {"guided_json": SCHEMA}, json_of("enum")),
    ("guided_regex", BOTH, {"guided_regex": "[0-9]{3}"}, matches("[0-9]{3}")),
    ("guided_grammar", BOTH, {"guided_grammar": 'root ::= "yes" | "no"'}, one_of({"yes", "no"})),
    ("guided_choice", BOTH, {"guided_choice": ["alpha", "beta"]}, one_of({"alpha", "beta"})),
    ("guided_json_object", BOTH, {"guided_json_object": True}, json_of("object")),
    ("guided_decoding_backend", BOTH, {"guided_decoding_backend": "outlines"}, refused),
    ("guided_whitespace_pattern", BOTH, {"guided_whitespace_pattern": " "}, refused),
    ("structural_tag", BOTH, {"structural_tag": "{}"}, refused),
    ("early_stopping", BOTH, {"early_stopping": True}, refused),
    ("logits_processors", BOTH, {"logits_processors": ["x"]}, refused),
    # milo's own
    ("k", BOTH, {"k": 1}, retrieved_k),
    ("token_budget", BOTH, {"token_budget": 10_000}, greedy),
    ("recompute", BOTH, {"recompute": 2}, fewer_cached),
]
CASES = [pytest.param(api, fields, check, id=f"{api}-{name}") for name, apis, fields, check in FIELDS for api in apis]


@pytest.mark.parametrize("api, fields, check", CASES)
def test_each_field_is_honoured_or_refused_naming_it(served, api, fields, check):
    check(served, api, fields)


@pytest.mark.parametrize("fields", [{"guided_regex": "[0-9]{3}", "min_tokens": 5},
                                    {"guided_choice": ["alpha", "beta"], "stop": ["a"]},
                                    {"guided_json": SCHEMA, "stop_token_ids": [1]},
                                    {"structured_outputs": {"grammar": 'root ::= "yes"'}, "ignore_eos": True}])
def test_a_structured_answer_refuses_an_ending_it_cannot_honour(served, fields):
    """A structured answer ends where its form is complete: a field that would end it elsewhere is a 400 naming it."""
    reply = ask(served, "completions", fields)
    named = [f for f in fields if f in ("min_tokens", "stop", "stop_token_ids", "ignore_eos")][0]
    assert reply.status_code == 400 and reply.json()["error"]["message"].startswith(f"{named}:")


def test_a_field_no_api_names_is_logged(caplog):
    from milo_infer.server.protocol import parse_request

    with caplog.at_level("WARNING", logger="milo.serve"):
        parse_request({"model": "s", "prompt": "hi", "min_token": 20}, chat=False, models={"s"}, max_positions=64)
    assert "'min_token'" in caplog.text


def test_logprob_bytes_are_a_tokens_own_byte_level_or_byte_fallback():
    """A token holding part of a character decodes to U+FFFD; its ``bytes`` are its own: a byte-level token's (GPT-2's
    alphabet) and a byte-fallback piece's (``<0xE2>``: 226), so a client joining them gets the answer's UTF-8."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "a": 257}
    fallback = Tokenizer(models.BPE(vocab=pieces, merges=[], byte_fallback=True, unk_token="<unk>"))
    fallback.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    fallback = PreTrainedTokenizerFast(tokenizer_object=fallback, unk_token="<unk>")
    text = "a─中🙂"
    for tokenizer in (byte_tokenizer(), fallback):
        ids = tokenizer.encode(text, add_special_tokens=False)
        content = Logprobs(tokenizer, chat=True).shape([TokenLogprob(t, -1.0) for t in ids])["content"]
        assert b"".join(bytes(c["bytes"]) for c in content) == text.encode("utf-8")
    e2 = Logprobs(fallback, chat=True).shape([TokenLogprob(fallback.convert_tokens_to_ids("<0xE2>"), -1.0)])
    assert e2["content"][0]["bytes"] == [226] and e2["content"][0]["token"] == "\ufffd"
