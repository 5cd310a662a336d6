"""Nothing hangs, nothing is lost: whatever the engine raises, and when, every request the server accepted
ends in an answer or an error, and only what failed fails (a fake engine told where to fail)."""
import asyncio
import json
import logging
import threading
import time

import httpx

from milo_infer.runtime.engine import Request
from milo_infer.server.metrics import ServerMetrics
from milo_infer.server.scheduler import EngineLoop, NotAccepting, ShuttingDown
from tests.infer.server.fake_engine import FakeEngine, expected_answer
from tests.infer.server.serving import metric, serving

LONG = "long " * 20  # 20 words: 20 steps


def post(base: str, prompt: str, **body) -> httpx.Response:
    return httpx.post(base + "/v1/completions", json={"model": "demo", "prompt": prompt, **body}, timeout=10)


def error_of(response: httpx.Response, status: int) -> dict:
    """The body's error, in OpenAI's shape, of a response that has ``status``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def sse(lines) -> list:
    """The payloads of a stream's SSE frames, ending with the string '[DONE]'."""
    payloads = [line.removeprefix("data: ") for line in lines if line]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def streamed_text(frames: list) -> str:
    return "".join(f["choices"][0]["text"] for f in frames if isinstance(f, dict) and f.get("choices"))


def asgi_get(app, path: str) -> httpx.Response:
    """GET ``path`` from the app itself, without a server (one that has exited, say)."""
    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://app") as client:
            return await client.get(path)
    return asyncio.run(get())


def test_an_admission_that_raises_fails_only_its_request(caplog):
    engine = FakeEngine(step_s=0.02)
    with serving(engine, batch_wait_ms=1) as served:
        with httpx.stream("POST", served.base + "/v1/completions", timeout=10,
                          json={"model": "demo", "prompt": LONG, "max_tokens": 20, "stream": True}) as running:
            lines = running.iter_lines()
            first = next(lines)  # the long row is in the batch
            with caplog.at_level(logging.ERROR, logger="milo.serve"):
                error = error_of(post(served.base, "please choke now"), 500)
            frames = sse([first, *lines])
        assert error["code"] == "engine_failed" and "RuntimeError: the prefix rebuild fell over" in error["message"]
        assert frames[-1] == "[DONE]" and streamed_text(frames) == expected_answer(LONG, 20)[0]  # it went on
        assert httpx.get(served.base + "/health").status_code == 200
        assert post(served.base, "next one").json()["choices"][0]["text"] == "NEXT ONE"
    assert len(engine.batches) == 1
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        "admitting 1 request(s) failed; they fail, the batch goes on"]  # logged once


def test_a_step_that_raises_fails_its_batch_and_the_loop_goes_on_with_a_new_one():
    engine = FakeEngine(step_s=0.02)
    with serving(engine, batch_wait_ms=1) as served:
        with httpx.stream("POST", served.base + "/v1/completions", timeout=10,
                          json={"model": "demo", "prompt": LONG, "max_tokens": 20, "stream": True}) as running:
            lines = running.iter_lines()
            first = next(lines)
            crashed = post(served.base, "please crash now")  # joins the batch; its first step raises
            frames = sse([first, *lines])
        error = error_of(crashed, 500)
        assert error["code"] == "engine_failed" and "RuntimeError: the device fell over" in error["message"]
        assert frames[-1] == "[DONE]" and frames[-2]["error"]["code"] == "engine_failed"  # its batch's row
        assert httpx.get(served.base + "/health").status_code == 200
        assert post(served.base, "next one").json()["choices"][0]["text"] == "NEXT ONE"
    assert len(engine.batches) == 2


def test_a_loop_that_cannot_make_a_batch_answers_all_it_holds_and_ends_the_server_with_1():
    queued_now = threading.Event()
    engine = FakeEngine(batch_limit=1, crash_gate=queued_now)  # the crash waits until a request queues behind it
    with serving(engine, max_batch=1, batch_wait_ms=1) as served:
        queued = []
        with httpx.stream("POST", served.base + "/v1/completions", timeout=10,
                          json={"model": "demo", "prompt": "please crash now", "stream": True}) as crashing:
            lines = crashing.iter_lines()
            first = next(lines)  # admitted: its first step is under way
            behind = threading.Thread(target=lambda: queued.append(post(served.base, "behind it")))
            behind.start()
            deadline = time.monotonic() + 5
            while metric(served.base, 'milo:num_requests_waiting{model_name="demo"}') != 1:
                assert time.monotonic() < deadline, "the second request was not queued"
                time.sleep(0.01)
            queued_now.set()
            frames = sse([first, *lines])
        behind.join(10)
        served.thread.join(10)
        assert not served.thread.is_alive() and served.server.exit_code == 1  # it ended by itself
    assert frames[-1] == "[DONE]" and frames[-2]["error"]["code"] == "engine_failed"
    error = error_of(queued[0], 500)
    assert "no device memory left for a batch" in error["message"]
    health = asgi_get(served.app, "/health")
    assert health.status_code == 503 and health.json() == {"status": "failed"}


def test_a_submit_racing_the_loops_end_is_answered():
    """The loop ends (stops, or fails) while a submit is between its check and its enqueue: that request is
    still answered, not left in a queue nobody reads."""
    engine = FakeEngine()
    loop = EngineLoop(engine, ServerMetrics())
    loop.start()
    enqueue = loop.waiting.put_nowait

    def enqueue_once_the_loop_had_time_to_end(ticket):
        loop.stop(timeout=0.5)
        enqueue(ticket)

    loop.waiting.put_nowait = enqueue_once_the_loop_had_time_to_end
    answers = []
    try:
        loop.submit(engine.plan("demo", Request("hi")), answers.append)
    except NotAccepting:
        answers.append("refused")
    deadline = time.monotonic() + 5
    while not answers:
        assert time.monotonic() < deadline, "the request was never answered"
        time.sleep(0.01)
    assert answers == ["refused"] or isinstance(answers[0], ShuttingDown)
