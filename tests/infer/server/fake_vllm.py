"""A stand-in for a vLLM OpenAI server on loopback, for `milo serve --vllm`'s tests: no model, known answers,
failures to order, and a server that can be stopped and started again on its port.

A completion's prompt is text (the engine under test sends ``plan.request.text``); the answer is its words
upper-cased, one SSE frame each, as `fake_engine.expected_answer` says, then a usage frame and ``[DONE]``.
The word ``fail`` sends vLLM's mid-stream error frame instead of the words after it, ``garble`` a frame
milo cannot read (``choices`` not a list), ``cut`` ends the stream there without ``[DONE]``. With an
``api_key``, /v1 answers 401 to a request without 'Authorization: Bearer KEY' (as vLLM's --api-key).
"""
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from milo_infer.runtime.planning import QueryPlan
from milo_infer.vllm.engine import VllmEngine
from tests.infer.server.fake_engine import FakeEngine, expected_answer

MODEL = "fake-vllm-model"


def fake_vllm_app(api_key: str | None) -> FastAPI:
    app = FastAPI()
    app.state.authorizations = []  # the Authorization header of every completion request

    def refused(request: Request):
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": {"message": "Unauthorized"}}, status_code=401)
        return None

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models(request: Request):
        return refused(request) or {"object": "list", "data": [{"id": MODEL, "max_model_len": 2048}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        app.state.authorizations.append(request.headers.get("authorization"))
        if (response := refused(request)) is not None:
            return response
        body = await request.json()
        return StreamingResponse(frames(body), media_type="text/event-stream")

    return app


def frames(body: dict):
    words = body["prompt"].split()
    text, reason = expected_answer(body["prompt"], body["max_tokens"])
    answer = text.split()
    for i, word in enumerate(words):
        if word == "fail":
            yield "data: " + json.dumps({"error": {"message": "the engine died", "type": "InternalServerError",
                                                   "param": None, "code": 500}}) + "\n\n"
            yield "data: [DONE]\n\n"
            return
        if word == "garble":
            yield 'data: {"choices": 7}\n\n'
            return
        if word == "cut":
            return
        if i < len(answer):
            last = i == len(answer) - 1
            choice = {"index": 0, "text": (" " if i else "") + answer[i], "finish_reason": reason if last else None}
            yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
    usage = {"prompt_tokens": len(words), "completion_tokens": len(answer)}
    yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
    yield "data: [DONE]\n\n"


class FakeVllm:
    """`fake_vllm_app` under uvicorn on one loopback port, which ``stop`` and ``start`` may close and reopen."""

    def __init__(self, api_key: str | None = None):
        self.app = fake_vllm_app(api_key)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = self.thread = self.sock = None

    def start(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the fake vLLM did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
        assert not self.thread.is_alive()


class FakePlannedVllmEngine(VllmEngine):
    """`VllmEngine` as `milo serve --vllm` drives it (its HTTP client, streaming, errors and health), planning
    as the fake engine does, so that no model or store is loaded; vLLM is asked ``plan.request.text``."""

    def mount(self, served, stores, model, settings) -> None:
        self.planner = FakeEngine()
        self.stores, self.max_positions, self.settings = self.planner.stores, served["max_model_len"], settings

    def plan(self, store: str, request) -> QueryPlan:
        return self.planner.plan(store, request)

    def request_body(self, plan: QueryPlan) -> dict:
        return {"model": self.model_name, "prompt": plan.request.text, "max_tokens": plan.max_new_tokens}
