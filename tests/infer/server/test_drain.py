"""The graceful drain (SIGTERM, Ctrl-C): /health and new requests answer 503 at once, requests already in
go on for up to drain_s, and those still unanswered then end with an error, never a cut socket
(an in-process server over a slow fake engine; test_serve.py drains a real `milo serve`)."""
import logging
import signal
import threading
import time

import httpx

from tests.infer.server.fake_engine import FakeEngine, expected_answer
from tests.infer.server.serving import metric, serving
from tests.infer.server.test_failures import error_of, post, sse, streamed_text

RUNNING = 'milo:num_requests_running{model_name="demo"}'


def in_background(base: str, prompt: str, **body) -> tuple[threading.Thread, list]:
    """A non-streamed request on a thread of its own; its response lands in the list."""
    responses = []
    thread = threading.Thread(target=lambda: responses.append(post(base, prompt, **body)))
    thread.start()
    return thread, responses


def wait_until(condition, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_drain_lets_requests_in_flight_finish_and_refuses_new_ones():
    engine = FakeEngine(step_s=0.2)  # 1.6 s a row: time for the second to be planned and join on a loaded machine
    words = "one two three four five six seven eight"
    with serving(engine, drain_s=30, batch_wait_ms=1) as served:
        with httpx.stream("POST", served.base + "/v1/completions", timeout=10,
                          json={"model": "demo", "prompt": words, "stream": True}) as streaming:
            lines = streaming.iter_lines()
            first = next(lines)
            thread, answered = in_background(served.base, words)
            wait_until(lambda: metric(served.base, RUNNING) == 2, "both rows running")
            started = time.monotonic()
            served.server.handle_exit(signal.SIGTERM, None)
            health = httpx.get(served.base + "/health")
            late = post(served.base, "too late")
            frames = sse([first, *lines])
        thread.join(10)
        served.thread.join(10)
        assert not served.thread.is_alive() and time.monotonic() - started < 5  # it did not wait out drain_s
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    assert error_of(late, 503)["code"] == "shutting_down"
    assert frames[-1] == "[DONE]" and streamed_text(frames) == expected_answer(words)[0]
    assert answered[0].status_code == 200 and answered[0].json()["choices"][0]["text"] == expected_answer(words)[0]
    assert served.server.exit_code == 0


def test_a_request_being_planned_when_the_drain_starts_is_answered():
    """The drain waits for it as for a running one (uvicorn's own wait, close_s, would cut it)."""
    engine = FakeEngine(plan_s=0.5)
    with serving(engine, drain_s=30, close_s=0.1) as served:
        thread, answered = in_background(served.base, "planned slowly")
        wait_until(lambda: served.app.state.preparing == 1, "the request is being planned")
        served.server.handle_exit(signal.SIGTERM, None)
        thread.join(10)
        served.thread.join(10)
        assert not served.thread.is_alive()
    assert answered[0].status_code == 200 and answered[0].json()["choices"][0]["text"] == "PLANNED SLOWLY"


def test_requests_unanswered_when_the_drain_ends_get_an_error_not_a_cut_socket(caplog):
    engine = FakeEngine(step_s=0.05)
    long = "w " * 30  # 30 steps: 1.5 s
    with caplog.at_level(logging.INFO), serving(engine, drain_s=0.3, batch_wait_ms=1) as served:
        with httpx.stream("POST", served.base + "/v1/completions", timeout=10,
                          json={"model": "demo", "prompt": long, "max_tokens": 30, "stream": True}) as streaming:
            lines = streaming.iter_lines()
            first = next(lines)
            thread, answered = in_background(served.base, long, max_tokens=30)
            wait_until(lambda: metric(served.base, RUNNING) == 2, "both rows running")
            served.server.handle_exit(signal.SIGTERM, None)
            frames = sse([first, *lines])
        thread.join(10)
        served.thread.join(10)
        assert not served.thread.is_alive()
    assert frames[-2]["error"]["code"] == "shutting_down" and frames[-1] == "[DONE]"
    assert error_of(answered[0], 503)["code"] == "shutting_down"
    assert served.server.exit_code == 0
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]  # no traceback
    assert any("drain is over" in r.getMessage() for r in caplog.records)
