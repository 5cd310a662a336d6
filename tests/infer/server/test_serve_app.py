"""The HTTP layer and the engine loop of `milo serve`, on a real uvicorn server on loopback over a fake engine.

The fake engine (tests/infer/server/fake_engine.py) has the engine's interface and a known answer for every
query, so these tests hold the scheduler and the wire format to what they promise without a model.
"""
import asyncio
import json
import time

import httpx
import openai
import pytest

from milo_infer.server.protocol import StreamedText
from tests.infer.server.fake_engine import FakeEngine, expected_answer
from tests.infer.server.serving import metric, serving

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(stores=("demo", "other"))
    with serving(engine, max_batch=8, batch_wait_ms=20) as served:
        yield served.base, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=10)


def test_completion_through_the_openai_client(client):
    r = client.completions.create(model="demo", prompt="where is my new card", max_tokens=16)
    assert r.object == "text_completion" and r.model == "demo" and r.id.startswith("cmpl-")
    assert r.choices[0].text == "WHERE IS MY NEW CARD" and r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (15, 5, 20)
    assert r.usage.prompt_tokens_details.cached_tokens == 10  # the prefix the fake plan rebuilds from the store
    milo = r.model_extra["milo"]
    assert milo["groups"] == [1] and milo["blocks"] == [1, 0]
    assert (milo["kv_bytes_full"], milo["kv_bytes_stored"]) == (400, 100) and "model" in milo["seconds"]


def test_max_tokens_and_stop_reach_the_engine(client):
    r = client.completions.create(model="demo", prompt="one two three four five", max_tokens=2)
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("ONE TWO", "length")
    r = client.completions.create(model="demo", prompt="one two three four five", stop=["THREE"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("ONE TWO", "stop")


def test_extra_body_k_and_token_budget_are_accepted(client):
    r = client.completions.create(model="demo", prompt="a b", extra_body={"k": 2, "token_budget": 300})
    assert r.choices[0].text == "A B"


def test_extra_body_recompute_reaches_the_engines_request():
    from milo_infer.server.protocol import parse_request
    body = {"model": "demo", "prompt": "a b", "recompute": 16}
    assert parse_request(body, chat=False, models={"demo"}, max_positions=2048).request.recompute == 16
    assert parse_request({**body, "recompute": None}, chat=False, models={"demo"}, max_positions=2048).request.recompute is None


def test_chat_completion_answers_its_one_user_message(client):
    r = client.chat.completions.create(model="other", messages=[{"role": "user", "content": "card never arrived"}])
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == "CARD NEVER ARRIVED"
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 3


def test_streams_add_up_to_the_whole_answer(client):
    text = "my card is lost please help me now"
    whole = client.completions.create(model="demo", prompt=text).choices[0].text
    chunks = list(client.completions.create(model="demo", prompt=text, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole == expected_answer(text)[0]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    chat = list(client.chat.completions.create(model="demo", messages=[{"role": "user", "content": text}], stream=True,
                                               stream_options={"include_usage": True}))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == whole
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == len(whole.split())
    assert chat[-1].usage.prompt_tokens_details.cached_tokens == 10


def test_sampling_logprobs_n_a_system_message_turns_and_forms_reach_the_engines_request():
    from milo_infer.server.protocol import parse_request

    def parsed(body, chat=True):
        base = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]} if chat else {"model": "demo",
                                                                                               "prompt": "hi"}
        return parse_request({**base, **body}, chat=chat, models={"demo"}, max_positions=2048)

    front_end = parsed({"temperature": 0.7, "top_p": 0.8, "top_k": -1, "min_p": 0.05, "seed": 3, "n": 4,
                        "presence_penalty": 0.5, "logprobs": True, "top_logprobs": 5, "messages": [
                            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "card gone"},
                            {"role": "assistant", "content": "lost_card"}, {"role": "user", "content": "and now?"}]})
    s = front_end.request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.presence_penalty, s.logprobs) == (0.7, 0.8, 0, 0.05, 3,
                                                                                                  0.5, 5)
    assert front_end.n == 4 and front_end.request.text == "and now?" and front_end.request.system == "Be brief."
    assert front_end.request.turns == (("card gone", "lost_card"),)
    assert parsed({"logprobs": 0}, chat=False).request.sampling.logprobs == 0
    assert parsed({}).request.sampling.greedy and parsed({}).request.sampling.logprobs is None
    schema = {"type": "string", "enum": ["a", "b"]}
    kind, source = parsed({"response_format": {"type": "json_schema", "json_schema": {
        "name": "label", "schema": schema}}}).request.grammar
    assert kind == "json" and json.loads(source) == schema
    assert parsed({"guided_choice": ["a", "b"]}).request.choices == ("a", "b")
    assert parsed({"structured_outputs": {"choice": ["x"]}}).request.choices == ("x",)


def test_logprobs_and_n_answers_in_both_formats_streamed_or_not(client):
    r = client.completions.create(model="demo", prompt="card lost now", n=2, logprobs=2)
    assert [c.index for c in r.choices] == [0, 1] and {c.text for c in r.choices} == {"CARD LOST NOW"}
    lp = r.choices[1].logprobs
    assert lp.tokens == [" CARD", " LOST", " NOW"] and lp.token_logprobs == [-0.5] * 3 and lp.text_offset == [0, 5, 10]
    assert lp.top_logprobs[0] == {" CARD": -0.5, " card0": -1.5}
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == 13  # the prompt once, both answers' tokens
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "card lost"}],
                                          logprobs=True, top_logprobs=1)
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [" CARD", " LOST"] and content[0].bytes == list(b" CARD")
    assert [t.token for t in content[0].top_logprobs] == [" CARD"]
    assert client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}]
                                          ).choices[0].logprobs is None
    chunks = list(client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "a b c"}], n=3,
                                                 logprobs=True, stream=True, stream_options={"include_usage": True}))
    for i in range(3):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.delta.content or "" for c in mine) == "A B C" and mine[-1].finish_reason == "stop"
        assert [t.token for c in mine if c.logprobs for t in c.logprobs.content] == [" A", " B", " C"]
    assert chunks[-1].usage.completion_tokens == 9


def test_streamed_text_never_sends_what_the_answer_strips():
    """Deltas join to the stripped answer: leading whitespace never goes out, whitespace inside goes out with
    the text after it, trailing whitespace never goes out."""
    deltas = [" ", "\n", "Hello", " ", "\n", "world", " ", "\n\n"]
    text = StreamedText()
    sent = [text.push(d) for d in deltas]
    assert sent == ["", "", "Hello", "", "", " \nworld", "", ""]
    assert "".join(sent) == "".join(deltas).strip()


def test_models_lists_the_mounted_stores(client):
    assert sorted(m.id for m in client.models.list()) == ["demo", "other"]


def test_raw_sse_framing(server):
    with httpx.stream("POST", f"{server[0]}/v1/completions", json={"model": "demo", "prompt": "a b c", "stream": True},
                      timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    payloads = [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]
    assert all(f.startswith("data: ") for f in frames[:-1])
    assert [p["choices"][0]["text"] for p in payloads] == ["A", " B", " C"]
    assert {p["object"] for p in payloads} == {"text_completion"} and len({p["id"] for p in payloads}) == 1


BAD_INPUTS = [
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "must be a JSON object"),
    ("/v1/completions", {"model": "demo"}, 400, "prompt", "prompt"),
    ("/v1/completions", {"model": "demo", "prompt": "  "}, 400, "prompt", "is empty"),
    ("/v1/completions", {"model": "demo", "prompt": ["a", "b"]}, 400, "prompt", "one string"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model", "model"),
    ("/v1/completions", {"model": "../etc", "prompt": "hi"}, 404, "model", "not mounted"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "between 1 and 2048"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 4096}, 400, "max_tokens", "between 1 and 2048"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": "9"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "n": 17}, 400, "n", "between 1 and 16"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "temperature": 2.5}, 400, "temperature", "at most 2"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "top_p": 0}, 400, "top_p", "above 0"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "seed": "7"}, 400, "seed", "integer"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "echo": True}, 400, "echo", "echo"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "k": 0}, 400, "k", "at least 1"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "recompute": -1}, 400, "recompute", "between 0 and 2048"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ("/v1/completions", {"model": "demo", "prompt": "w " * 41}, 400, None, "exceeds the model's positions"),
    ("/v1/completions", {"model": "demo", "prompt": "x" * 70_000}, 413, None, "exceeds the server's limit"),
    ("/v1/chat/completions", {"model": "demo", "messages": []}, 400, "messages", "non-empty list"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "system", "content": "x"}]}, 400, "messages", "user"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "be brief"},
                                                            {"role": "system", "content": "hi"}]},
     400, "messages", "then user and assistant turns in turn"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "first"},
                                                            {"role": "user", "content": "second"}]},
     400, "messages", "got roles ['user', 'user']"),
    ("/v1/completions", b"[" * 30_000 + b"]" * 30_000, 400, None, "nests too deeply"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "best_of": 3}, 400, "best_of", "best_of=1"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty", "at most 2"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "frequency_penalty": "x"}, 400, "frequency_penalty", "number"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "logit_bias": {"50256": -100}}, 400, "logit_bias", "biases"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "logprobs": 21}, 400, "logprobs", "between 0 and 20"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "suffix": "!"}, 400, "suffix", "suffix"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options", "only allowed with stream"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "logprobs": 2},
     400, "logprobs", "true or false"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     400, "top_logprobs", "needs logprobs: true"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "xml"}}, 400, "response_format", "json_schema or json_object"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}, "guided_choice": ["a"]}, 400,
     "response_format", "one form of structured output"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "guided_choice": []}, 400, "guided_choice", "non-empty list"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "tool calling"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"},
     400, "tool_choice", "tool calling"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                              "modalities": ["text", "audio"]}, 400, "modalities", "only text"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                              "reasoning_effort": "high"}, 400, "reasoning_effort", "does not reason"),
]


@pytest.mark.parametrize("path, body, status, param, words", BAD_INPUTS)
def test_each_bad_input_is_a_4xx_in_openai_shape_naming_it(path, body, status, param, words):
    engine = FakeEngine()
    with serving(engine, max_body_bytes=64_000) as served:
        base = served.base
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(base + path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
        assert words in error["message"] and error["type"] == "invalid_request_error"
        assert r.headers["x-should-retry"] == "false"
        assert httpx.get(base + "/health").status_code == 200  # still up
        assert httpx.post(base + path, json={"model": "demo", "prompt": "ok", "messages": [
            {"role": "user", "content": "ok"}]}).status_code == 200


def test_fields_that_ask_for_nothing_are_accepted(client):
    """Defaults and fields that change nothing (greedy decoding ignores a seed) are no reason to refuse."""
    r = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "card lost"}], temperature=0, top_p=1, n=1,
        presence_penalty=0, frequency_penalty=0.0, logit_bias={}, logprobs=False, tools=[], tool_choice="none",
        response_format={"type": "text"}, modalities=["text"], seed=7, user="someone", metadata={"team": "a"},
        store=False, parallel_tool_calls=False, service_tier="auto")
    assert r.choices[0].message.content == "CARD LOST"
    r = client.completions.create(model="demo", prompt="card lost", echo=False, best_of=1, suffix=None, user="u")
    assert r.choices[0].text == "CARD LOST"


def test_unknown_routes_wrong_methods_and_bugs_answer_in_openai_shape(monkeypatch):
    engine = FakeEngine()

    def broken_plan(store, request):
        raise ZeroDivisionError("a bug")

    with serving(engine) as served:
        for method, path, status, code in (("GET", "/v1/nothing", 404, "not_found"),
                                           ("GET", "/v1/completions", 405, "method_not_allowed"),
                                           ("POST", "/v1/models", 405, "method_not_allowed")):
            r = httpx.request(method, served.base + path)
            assert r.status_code == status and r.headers["x-should-retry"] == "false"
            assert r.json()["error"]["code"] == code and path in r.json()["error"]["message"]
        assert "GET" in httpx.post(served.base + "/v1/models").headers["allow"]
        monkeypatch.setattr(engine, "plan", broken_plan)
        r = httpx.post(served.base + "/v1/completions", json={"model": "demo", "prompt": "hi"})
        assert r.status_code == 500 and "x-should-retry" not in r.headers
        assert r.json()["error"] == {"message": "the server failed on this request (ZeroDivisionError); its log has "
                                                "the details", "type": "server_error", "param": None,
                                     "code": "internal_error"}


def test_api_key_guards_every_endpoint_but_health():
    with serving(FakeEngine(), api_key=KEY) as served:
        base = served.base
        body = {"model": "demo", "prompt": "hi"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}):
            for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                 ("GET", "/v1/models"), ("GET", "/metrics")):
                r = httpx.request(method, base + path, json=body, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, path)
        assert httpx.get(base + "/health").status_code == 200
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        assert client.completions.create(model="demo", prompt="hi").choices[0].text == "HI"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_batches_form_and_answers_match_sequential_ones():
    engine = FakeEngine(step_s=0.005)
    queries = [f"query number {i} " + "word " * (i % 7) for i in range(48)]
    with serving(engine, max_batch=8, batch_wait_ms=20) as served:
        base = served.base
        async def ask_all():
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=20)
            limit = asyncio.Semaphore(16)

            async def ask(q):
                async with limit:
                    return (await client.completions.create(model="demo", prompt=q, max_tokens=6)).choices[0].text
            try:
                return await asyncio.gather(*(ask(q) for q in queries))
            finally:
                await client.close()

        answers = asyncio.run(asyncio.wait_for(ask_all(), 60))
        assert answers == [expected_answer(q, 6)[0] for q in queries]
        expected = [expected_answer(q, 6) for q in queries]
        for reason in ("length", "stop"):
            assert metric(base, f'milo:request_success_total{{finished_reason="{reason}",model_name="demo"}}') == sum(
                r == reason for _, r in expected)
        generated = metric(base, 'milo:generation_tokens_total{model_name="demo"}')
        assert generated == sum(len(a.split()) for a, _ in expected)
        assert metric(base, "milo:batch_size_count") > 0
        assert metric(base, 'milo:batch_size_bucket{le="1.0"}') < metric(base, "milo:batch_size_count")  # batches > 1
        assert metric(base, 'milo:num_requests_running{model_name="demo"}') == 0
    batch = engine.batches[0]
    assert max(batch.step_rows) <= 8 and max(batch.admissions) > 1


def test_a_short_answer_joins_and_leaves_while_a_long_one_runs():
    engine = FakeEngine(step_s=0.01)
    with serving(engine, max_batch=4, batch_wait_ms=1) as served:
        base = served.base
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=20)
        stream = client.completions.create(model="demo", prompt="long " * 30, max_tokens=30, stream=True)
        first = next(iter(stream))  # the long row is running
        started = time.monotonic()
        short = client.completions.create(model="demo", prompt="short", max_tokens=30)
        short_done = time.monotonic()
        rest = [c.choices[0].text for c in stream]
        long_done = time.monotonic()
    assert short.choices[0].text == "SHORT" and first.choices[0].text + "".join(rest) == expected_answer("long " * 30, 30)[0]
    assert short_done - started < long_done - started
    batch = engine.batches[0]
    assert batch.running_at_admission == [0, 1]  # admitted beside the running row, not after it


def test_a_full_queue_answers_503_with_retry_after():
    engine = FakeEngine(step_s=0.02)
    with serving(engine, max_batch=1, max_queue=1, batch_wait_ms=0) as served:
        base = served.base
        async def burst():
            async with httpx.AsyncClient(timeout=20) as http:
                return await asyncio.gather(*(http.post(base + "/v1/completions", json={
                    "model": "demo", "prompt": "w " * 8}) for _ in range(8)))

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert 200 in codes and 503 in codes and set(codes) == {200, 503}
        busy = next(r for r in responses if r.status_code == 503)
        assert busy.headers["Retry-After"] == "1" and busy.json()["error"]["code"] == "queue_full"


def test_a_client_leaving_mid_stream_cancels_its_row():
    engine = FakeEngine(step_s=0.02)
    with serving(engine) as served:
        base = served.base
        with httpx.stream("POST", base + "/v1/completions", timeout=10,
                          json={"model": "demo", "prompt": "w " * 30, "max_tokens": 30, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert metric(base, 'milo:num_requests_running{model_name="demo"}') == 1
        deadline = time.monotonic() + 5
        while metric(base, 'milo:num_requests_running{model_name="demo"}') != 0:
            assert time.monotonic() < deadline, "the row was not cancelled"
            time.sleep(0.02)
        assert len(engine.batches[0].cancelled) == 1 and len(engine.batches[0]) == 0


def test_a_client_leaving_a_non_streamed_request_cancels_its_row():
    engine = FakeEngine(step_s=0.02)
    with serving(engine) as served:
        base = served.base
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json={"model": "demo", "prompt": "w " * 30, "max_tokens": 30},
                       timeout=0.2)
        deadline = time.monotonic() + 5
        while not engine.batches[0].cancelled:
            assert time.monotonic() < deadline, "the row was not cancelled"
            time.sleep(0.02)
        assert "milo:request_success_total{" not in httpx.get(base + "/metrics").text  # nothing finished


def test_metrics_use_vllm_names_under_milo(server, client):
    client.completions.create(model="demo", prompt="count me")
    text = httpx.get(server[0] + "/metrics").text
    for name in ("milo:num_requests_running", "milo:num_requests_waiting", "milo:request_success_total",
                 "milo:prompt_tokens_total", "milo:generation_tokens_total", "milo:e2e_request_latency_seconds_bucket",
                 "milo:time_to_first_token_seconds_bucket", "milo:request_queue_time_seconds_bucket",
                 "milo:inter_token_latency_seconds_bucket", "milo:batch_size_bucket", "milo:kv_bytes_moved_total",
                 "milo:kv_bytes_stored_total", "milo:unique_block_share", "milo:blocks_read_total",
                 "milo:object_store_bytes_total", "milo:object_store_gets_total", "milo:unreadable_blocks_total",
                 "milo:recomputed_blocks_total", "milo:request_aborted_total", "process_cpu_seconds_total",
                 "python_info"):
        assert f"\n{name}" in text, name
    for store in ("demo", "other"):  # vLLM's label, naming the store
        assert f'milo:num_requests_running{{model_name="{store}"}}' in text
    assert metric(server[0], "milo:unique_block_share") == 1.0  # the fake plans ask blocks [1, 0]
