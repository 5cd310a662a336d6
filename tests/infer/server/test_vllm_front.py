"""`milo serve --vllm`: milo's HTTP front over a vLLM server, here a fake one on loopback (tests/infer/server/
fake_vllm.py) that answers, fails mid-stream, sends what milo cannot read, requires an API key, and stops
and starts again. Every failure must end its own request with an error, never a truncated 200 or a hang."""
import json
import time

import httpx
import openai
import pytest

from milo_infer.vllm.engine import VllmUnavailable
from tests.infer.server.fake_engine import expected_answer
from tests.infer.server.fake_vllm import FakePlannedVllmEngine, FakeVllm
from tests.infer.server.serving import metric, serving

VLLM_KEY = "sk-vllm-key"
TIMEOUT_S = 10  # a request that hangs fails the test instead


@pytest.fixture
def vllm():
    fake = FakeVllm(api_key=VLLM_KEY)
    fake.start()
    yield fake
    if fake.thread.is_alive():
        fake.stop()


@pytest.fixture
def served(vllm):
    with serving(FakePlannedVllmEngine(vllm.url, {}, api_key=VLLM_KEY)) as served:
        yield served


def post(served, prompt: str, **body):
    return httpx.post(served.base + "/v1/completions", json={"model": "demo", "prompt": prompt, **body},
                      timeout=TIMEOUT_S)


def sse(served, prompt: str) -> list:
    with httpx.stream("POST", served.base + "/v1/completions", timeout=TIMEOUT_S,
                      json={"model": "demo", "prompt": prompt, "stream": True}) as r:
        assert r.status_code == 200
        return [f.removeprefix("data: ") for f in r.read().decode().split("\n\n") if f]


def test_answers_come_through_vllm_with_its_api_key(vllm, served):
    client = openai.OpenAI(base_url=served.base + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S)
    text = "where is my new card please"
    r = client.completions.create(model="demo", prompt=text, max_tokens=4)
    assert (r.choices[0].text, r.choices[0].finish_reason) == expected_answer(text, 4)
    streamed = list(client.completions.create(model="demo", prompt=text, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected_answer(text)[0]
    assert set(vllm.app.state.authorizations) == {f"Bearer {VLLM_KEY}"}


def test_a_wrong_vllm_api_key_is_refused_at_start(vllm):
    with pytest.raises(VllmUnavailable, match="401"):
        FakePlannedVllmEngine(vllm.url, {}, api_key="sk-wrong")


def test_an_error_frame_mid_stream_ends_the_request_with_502(served):
    r = post(served, "one two fail three")
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "upstream_failed" and "the engine died" in r.json()["error"]["message"]
    frames = sse(served, "one two fail three")
    assert frames[-1] == "[DONE]" and json.loads(frames[-2])["error"]["code"] == "upstream_failed"
    assert "".join(json.loads(f)["choices"][0]["text"] for f in frames[:-2]) == "ONE TWO"  # no finish "stop"
    assert all(json.loads(f)["choices"][0]["finish_reason"] is None for f in frames[:-2])
    assert metric(served.base, 'milo:request_errors_total{code="upstream_failed"}') == 2
    assert post(served, "still fine").json()["choices"][0]["text"] == "STILL FINE"


def test_a_stream_cut_short_is_a_502_not_a_shorter_answer(served):
    r = post(served, "one two cut three")
    assert r.status_code == 502 and "before its [DONE]" in r.json()["error"]["message"]


def test_anything_the_streaming_thread_raises_ends_its_request(served):
    r = post(served, "one garble two")
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_failed", r.text
    assert "TypeError" in r.json()["error"]["message"]
    frames = sse(served, "one garble two")
    assert frames[-1] == "[DONE]" and json.loads(frames[-2])["error"]["code"] == "engine_failed"


def test_an_unreachable_vllm_is_a_502_and_a_degraded_health_that_recovers(vllm, served):
    assert httpx.get(served.base + "/health").json() == {"status": "ok"}
    vllm.stop()
    r = post(served, "hello there")
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_failed", r.text
    health = httpx.get(served.base + "/health", timeout=TIMEOUT_S)
    assert health.status_code == 503 and health.json()["status"] == "degraded"
    assert vllm.url in health.json()["detail"]
    vllm.start()
    deadline = time.monotonic() + TIMEOUT_S
    while httpx.get(served.base + "/health", timeout=TIMEOUT_S).status_code != 200:
        assert time.monotonic() < deadline, "/health did not recover"
        time.sleep(0.05)
    assert post(served, "hello again").json()["choices"][0]["text"] == "HELLO AGAIN"


def test_a_refused_model_is_one_line_from_serve_over_vllm(vllm, tmp_path, capsys):
    """`milo serve --vllm` reads the model's config itself: a refused family is the same one line as from milo's own
    engine."""
    from transformers import AutoConfig

    from milo_infer.cli.main import main as milo
    from milo_store import CompressionConfig, Layout
    from milo_store.synthetic import build_synthetic_store

    AutoConfig.for_model("hunyuan_v1_moe").save_pretrained(tmp_path / "model")
    store = build_synthetic_store(tmp_path / "store", Layout(2, 2, 16), [10, 12], CompressionConfig(ratio=0.5))
    code = milo(["serve", str(store), "--vllm", vllm.url, "--vllm-api-key", VLLM_KEY, "--model", str(tmp_path / "model")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "depends on m and n, not on m - n alone" in err, err
