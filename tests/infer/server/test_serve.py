"""`milo serve` as a user runs it: a subprocess on a free loopback port over a small store built with the
real default model, talked to with the official openai client and raw httpx; nothing is left running.
"""
import asyncio
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.infer.demo_stores import DEMO, encoded_demo_stores
from milo_infer.building.config import BuildConfig
from milo_infer.building.shared_staging import encode_once
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.planning import Request
from milo_infer.tasks.corpus import load_corpus, task_from_corpus
from milo_infer.runtime.session import MiloSession
from milo_store import CompressionConfig, MiloStore

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]
KEY = "sk-milo-test"
START_TIMEOUT_S = 180
QUERIES = [d.input for d in load_corpus(DEMO)[8:24]]  # 16 queries outside the store's demonstrations


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, base: str, process: subprocess.Popen, log: Path):
        self.base, self.process, self.log = base, process, log

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def milo_serve(tmp_path: Path, stores, *options: str):
    """``milo serve STORES OPTIONS`` on a free port, once its /health answers; SIGTERM (then kill) on exit."""
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "milo_infer.cli.main", "serve", *map(str, stores),
                                    "--port", str(port), *options], env=env, stdout=out, stderr=subprocess.STDOUT)
    served = Served(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"milo serve exited with {process.returncode}:\n{served.output()[-3000:]}")
            try:
                if httpx.get(served.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"milo serve did not start in {START_TIMEOUT_S} s"
            time.sleep(0.25)
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, f"{name} not in /metrics"
    return values[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory, default_model):
    """A store of 8 demonstrations in 2 blocks, and each query's answer from `MiloSession`."""
    stores = encoded_demo_stores(tmp_path_factory, default_model, {"demo": CompressionConfig(ratio=0.5)})
    opened, _ = next(stores)
    store = opened["demo"]
    session = MiloSession(default_model, store)
    expected = {q: session.answer(q).text for q in QUERIES}
    yield Path(store.path), expected
    next(stores, None)


SYSTEM = "You sort customer messages by what they ask for."


@pytest.fixture(scope="module")
def system_store(tmp_path_factory, default_model):
    """An identity store (fp32) of the same 8 demonstrations built with a system prompt, each block of 4 encoded after
    the anchor alone: a one-block context holds exactly what a prefill of the same prompt computes."""
    corpus = load_corpus(DEMO)[:8]
    root = tmp_path_factory.mktemp("system")
    encode_once(default_model, corpus, dataclasses.replace(task_from_corpus(corpus), system=SYSTEM),
                BuildConfig(block_size=4, context_blocks=0, order="corpus"),
                {"demo-system": CompressionConfig(codec="identity", ratio=1.0, dtype="float32")}, root, progress=False)
    return root / "demo-system"


@pytest.fixture(scope="module")
def server(built, system_store, tmp_path_factory):
    with milo_serve(tmp_path_factory.mktemp("serve"), [built[0], system_store], "--api-key", KEY, "--max-batch",
                    "16", "--batch-wait-ms", "30") as served:
        yield served


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_answers_equal_the_sessions(client, built):
    _, expected = built
    for query in QUERIES[:3]:
        r = client.completions.create(model="demo", prompt=query, max_tokens=16)
        assert r.choices[0].text == expected[query]
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens > 0
        assert r.model_extra["milo"]["blocks"] and r.model_extra["milo"]["kv_bytes_stored"] > 0
        assert r.usage.prompt_tokens_details.cached_tokens == r.model_extra["milo"]["prefix_tokens"] > 0
        chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": query}])
        assert chat.choices[0].message.content == expected[query]
        streamed = client.completions.create(model="demo", prompt=query, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == expected[query]  # exactly, unstripped
    assert [m.id for m in client.models.list()] == ["demo", "demo-system"]


def test_milo_serve_says_at_start_what_its_kv_budget_holds(server):
    """One line, computed by the engine (`Engine.budget_summary`; its numbers: tests/infer/runtime/test_kv_memory.py)."""
    said = re.search(r"milo serve: K/V budget [\d.]+ GiB: ([\d,]+) pages of 128 columns, up to ([\d,]+) rows of "
                     r"store '[^']+''s prefix \(6 groups and the answer budget: [\d,]+ columns, queries aside\)",
                     server.output())
    assert said is not None, server.output()[-2000:]
    assert int(said[1].replace(",", "")) >= int(said[2].replace(",", "")) > 0


def test_raw_sse_framing_and_error_bodies(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.base + "/v1/completions", headers=auth, timeout=60,
                      json={"model": "demo", "prompt": QUERIES[0], "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = r.read().decode().split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    bad = {"unknown model": ({"model": "nope", "prompt": "hi"}, 404, "not mounted"),
           "too many tokens": ({"model": "demo", "prompt": "hi", "max_tokens": 10 ** 6}, 400, "max_tokens"),
           "context too long": ({"model": "demo", "prompt": "card " * 9000}, 400, "positions"),
           "n": ({"model": "demo", "prompt": "hi", "n": 17}, 400, "between 1 and 16")}
    for name, (body, status, words) in bad.items():
        r = httpx.post(server.base + "/v1/completions", headers=auth, json=body, timeout=60)
        assert r.status_code == status and words in r.json()["error"]["message"], (name, r.text)
    r = httpx.post(server.base + "/v1/completions", headers={"Authorization": "Bearer wrong"},
                   json={"model": "demo", "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert KEY not in server.output()  # no secret in the logs


def test_load_every_request_answered_as_sequentially_and_batched(server, built):
    _, expected = built
    queries = QUERIES * 8  # 128 requests

    async def load():
        client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)
        limit = asyncio.Semaphore(32)

        async def ask(query):
            async with limit:
                return (await client.completions.create(model="demo", prompt=query)).choices[0].text
        try:
            return await asyncio.gather(*(ask(q) for q in queries))
        finally:
            await client.close()

    answers = asyncio.run(asyncio.wait_for(load(), 150))
    assert answers == [expected[q] for q in queries]
    assert metric(server.base, 'milo:batch_size_bucket{le="1.0"}') < metric(server.base, "milo:batch_size_count")
    assert metric(server.base, 'milo:num_requests_running{model_name="demo"}') == 0


def test_a_client_leaving_mid_stream_frees_its_row(server):
    with httpx.stream("POST", server.base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": "demo", "prompt": QUERIES[1], "stream": True}) as r:
        assert next(r.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + 30
    while metric(server.base, 'milo:num_requests_running{model_name="demo"}') != 0:
        assert time.monotonic() < deadline, "the row stayed in the batch"
        time.sleep(0.1)
    assert httpx.get(server.base + "/health").status_code == 200


def test_sigterm_under_load_finishes_in_flight_requests_and_exits_0(built, tmp_path):
    _, expected = built
    with milo_serve(tmp_path, [built[0]], "--max-batch", "4", "--drain-s", "60") as served:
        async def load_then_term():
            async with httpx.AsyncClient(base_url=served.base, timeout=120) as http:
                in_flight = [asyncio.ensure_future(http.post("/v1/completions", json={"model": "demo", "prompt": q}))
                             for q in QUERIES[:12]]
                while metric(served.base, 'milo:num_requests_running{model_name="demo"}') == 0:
                    await asyncio.sleep(0.02)
                served.process.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                health = (await http.get("/health")).status_code
                late = await http.post("/v1/completions", json={"model": "demo", "prompt": "hi"})
                return await asyncio.gather(*in_flight), health, late

        responses, health, late = asyncio.run(asyncio.wait_for(load_then_term(), 150))
        assert [r.status_code for r in responses] == [200] * 12
        assert [r.json()["choices"][0]["text"] for r in responses] == [expected[q] for q in QUERIES[:12]]
        assert health == 503 and late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert served.process.wait(60) == 0, served.output()[-2000:]
        assert "Traceback" not in served.output()


def test_a_drain_that_runs_out_ends_what_is_left_with_errors_not_cut_sockets(built, tmp_path):
    with milo_serve(tmp_path, [built[0]], "--max-batch", "2", "--drain-s", "0") as served:
        async def load_then_term():
            async with httpx.AsyncClient(base_url=served.base, timeout=120) as http:
                async def streamed(query):
                    async with http.stream("POST", "/v1/completions", json={
                            "model": "demo", "prompt": query, "stream": True}) as r:
                        return [line async for line in r.aiter_lines() if line]
                posted = [asyncio.ensure_future(http.post("/v1/completions", json={"model": "demo", "prompt": q}))
                          for q in QUERIES[:4]]
                streams = [asyncio.ensure_future(streamed(q)) for q in QUERIES[4:6]]
                while metric(served.base, 'milo:num_requests_running{model_name="demo"}') == 0:
                    await asyncio.sleep(0.02)
                served.process.send_signal(signal.SIGTERM)
                return await asyncio.gather(*posted), await asyncio.gather(*streams)

        posted, streams = asyncio.run(asyncio.wait_for(load_then_term(), 150))
        assert served.process.wait(60) == 0, served.output()[-2000:]
    codes = [r.status_code for r in posted]
    assert set(codes) <= {200, 503} and 503 in codes, codes
    assert all(r.json()["error"]["code"] == "shutting_down" for r in posted if r.status_code == 503)
    assert all(lines[-1] == "data: [DONE]" for lines in streams)  # every stream ended, with or without an error
    assert "Traceback" not in served.output()


def test_refuses_to_start_naming_the_store_that_does_not_match_the_model(built, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(built[0], other)
    meta = json.loads((other / "zarr.json").read_text())
    meta["attributes"]["milo"]["model"]["config_hash"] = "0" * 64
    (other / "zarr.json").write_text(json.dumps(meta))
    done = subprocess.run([sys.executable, "-m", "milo_infer.cli.main", "serve", str(built[0]), str(other),
                           "--port", str(free_port())], env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and str(other) in done.stderr and "another model" in done.stderr, done.stderr
    twin = tmp_path / "elsewhere" / built[0].name
    shutil.copytree(built[0], twin)
    clash = subprocess.run([sys.executable, "-m", "milo_infer.cli.main", "serve", str(built[0]), str(twin)],
                           env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert clash.returncode == 2 and f"two stores share the name {built[0].name!r}" in clash.stderr, clash.stderr


def test_refuses_a_kv_budget_it_cannot_parse_or_that_holds_no_page(built):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    for value, says in (("-0.5", "argument --kv-cache-memory: KV cache memory '-0.5'"), ("1K", "holds no page")):
        done = subprocess.run([sys.executable, "-m", "milo_infer.cli.main", "serve", str(built[0]), "--port",
                               str(free_port()), "--kv-cache-memory", value], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_front_ends_request_sampled_with_a_system_message_and_seeds_that_reproduce_alone_and_in_16(client, server):
    """What a chat front end sends (temperature 0.7, top_p 0.8, its own system message), and seeded samples: each
    the same alone as among 15 other sampled requests in flight."""
    front = client.chat.completions.create(model="demo", temperature=0.7, top_p=0.8, messages=[
        {"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": QUERIES[0]}])
    assert front.choices[0].message.content and front.choices[0].finish_reason == "stop"

    def body(i, seed):
        return {"model": "demo", "prompt": QUERIES[i], "temperature": 1.0, "seed": seed, "logprobs": 0}

    alone = [client.completions.create(**body(i, 100 + i)) for i in range(3)]

    async def sixteen():
        async with openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(c.completions.create(**body(i % len(QUERIES), 100 + i)) for i in range(16)))

    together = asyncio.run(asyncio.wait_for(sixteen(), 150))
    for a, b in zip(alone, together[:3]):
        assert (a.choices[0].text, a.choices[0].logprobs.tokens) == (b.choices[0].text, b.choices[0].logprobs.tokens)


def test_label_log_probabilities_are_the_models_softmax_and_n_answers_share_one_retrieval(client, built,
                                                                                           default_model):
    """A lone row's label log probabilities against the model's softmax of the same row's logits computed here (on
    one thread, as the server runs); n answers are n choices whose tokens the usage counts."""
    r = client.completions.create(model="demo", prompt=QUERIES[1], logprobs=5, n=3, temperature=1.0, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == sum(
        len(c.logprobs.tokens) for c in r.choices)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with MiloStore.open(built[0]) as store:
            engine = Engine(default_model, {"demo": store})
            reference = torch.log_softmax(engine.logits([engine.plan("demo", Request(QUERIES[1]))])[0][-1].double(), 0)
    finally:
        torch.set_num_threads(threads)
    first = client.completions.create(model="demo", prompt=QUERIES[1], logprobs=5).choices[0].logprobs.top_logprobs[0]
    top = reference.topk(5)
    expected = {default_model.tokenizer.decode([t]): float(v) for t, v in zip(top.indices.tolist(), top.values)}
    assert max(abs(first[token] - lp) for token, lp in expected.items()) < 1e-5


def test_a_system_message_equal_to_the_stores_is_answered_as_a_prefill_of_the_same_prompt(client, system_store,
                                                                                        default_model):
    served = client.chat.completions.create(model="demo-system", logprobs=True, top_logprobs=3, extra_body={"k": 1},
                                            messages=[{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": QUERIES[2]}])
    card = {m.id: m.model_extra for m in client.models.list()}["demo-system"]
    assert card["system_prompt"] == SYSTEM
    with MiloStore.open(system_store) as store:
        engine = Engine(default_model, {"s": store})
        prefill = engine.answer([engine.plan("s", Request(QUERIES[2], k=1, prefill=True))])[0]
        logits = engine.logits([engine.plan("s", Request(QUERIES[2], k=1, prefill=True))])[0][-1].double()
    assert served.choices[0].message.content == prefill.text
    top = torch.log_softmax(logits, 0).topk(3)
    got = served.choices[0].logprobs.content[0].top_logprobs
    assert [t.token for t in got] == [default_model.tokenizer.decode([i]) for i in top.indices.tolist()]
    assert max(abs(t.logprob - float(v)) for t, v in zip(got, top.values)) < 1e-4


def test_a_label_schema_from_the_models_list_makes_every_answer_a_label(client):
    card = {m.id: m.model_extra for m in client.models.list()}["demo"]
    for query in QUERIES[:4]:
        r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": query}],
                                           response_format=card["response_format"], temperature=0.7, seed=1)
        assert json.loads(r.choices[0].message.content) in card["labels"]


def test_a_tiny_qwen3_5_builds_answers_and_serves(tmp_path):
    """A hybrid with Qwen3.5's released layer pattern (three Gated DeltaNet layers, then attention) saved as a user's
    directory: `milo build` stores its blocks' states beside their K/V, and `milo serve` answers from them as the
    engine does, free-form (issue 61)."""
    from milo_infer.cli.main import main as milo
    from milo_infer.models import load_model
    from tests.infer.test_check_model import saved

    model_dir = saved("qwen3_5_text", tmp_path / "model")
    store = tmp_path / "store"
    assert milo(["build", "--corpus", str(DEMO), "--shots", "8", "--block-size", "4", "--model", model_dir,
                 "--out", str(store), "--threads", "1"]) == 0
    queries = QUERIES[:4]
    with MiloStore.open(store) as opened:
        assert [spec.kind for spec in opened.layout.layers] == ["linear"] * 3 + ["attention"]
        engine = Engine(load_model(model_dir), {"store": opened})
        expected = [a.text for a in engine.answer([engine.plan("store", Request(q, max_new_tokens=16))
                                                   for q in queries])]
    with milo_serve(tmp_path, [store], "--model", model_dir, "--max-batch", "4") as served:
        client = openai.OpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0, timeout=60)
        answers = [client.completions.create(model="store", prompt=q, max_tokens=16).choices[0].text
                   for q in queries]
    assert answers == expected and all(expected)
