"""`milo serve --vllm URL`: milo's HTTP front over a running vLLM server that has the milo connector.

`VllmEngine` is a `ServingEngine` (``milo_infer.runtime.interface``), the face `milo serve`'s engine loop
drives, so the HTTP handlers, metrics and errors are the same as over milo's own engine. Planning
stays here (BM25 retrieval, the same groups and ids as milo's engine); each admitted plan becomes one
streamed vLLM completion whose prompt is [anchor][blocks][query] as token ids, with the store and
blocks in ``kv_transfer_params``, so vLLM batches, schedules and loads the prefix from the store
itself. A `VllmBatch` is the set of requests in flight: ``step`` hands back the deltas that arrived.

Whatever goes wrong with one vLLM request ends that request, never silently and never by hanging: vLLM
unreachable, a status other than 200, a mid-stream error frame, a finish_reason "error", a frame that is
not JSON or a stream ended before ``[DONE]`` end it with `VllmUnavailable` (a 502); anything else its
streaming thread raises, with `RowFailed` (a 500).
``upstream_problem`` (asked by ``/health``) says whether vLLM answers its own ``/health`` now.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import httpx
import torch
from transformers import AutoTokenizer

from milo_store import MiloStore

from ..models import (check_compatible, check_supported, config_identity, config_layer_rope_tables, media_tokens,
                      model_directory, read_config)
from ..runtime.interface import Answer, RowEvent
from ..runtime.errors import RequestError, RowFailed, UpstreamError
from ..runtime.decoding import UNTIL_EOS
from ..runtime.planning import STOP_STRINGS, EngineSettings, MountedStore, QueryPlan, Request
from .transfer import VllmPrompt, vllm_prompt

STEP_WAIT_S = 0.05  # how long a step waits for the first delta (then the loop may admit or cancel)
HEALTH_TIMEOUT_S = 2.0  # how long ``upstream_problem`` waits for vLLM's /health
log = logging.getLogger("milo.serve")


class VllmUnavailable(UpstreamError):
    """The vLLM server cannot be reached or refused a request milo checked (names the URL and reason)."""


class VllmEngine:
    def __init__(self, url: str, stores: dict[str, MiloStore], model="default",
                 settings: EngineSettings = EngineSettings(), *, api_key: str | None = None, timeout_s: float = 600.0):
        """``api_key``: sent to vLLM as 'Authorization: Bearer KEY' (vLLM's --api-key)."""
        if settings.recompute:
            raise ValueError("recompute is milo's own engine's: vLLM loads a stored prefix as it is")
        self.url = url.rstrip("/")
        self.client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                   headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
        try:
            served = self.client.get("/v1/models").raise_for_status().json()["data"][0]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise VllmUnavailable(f"no vLLM server answers at {self.url}/v1/models ({e})") from None
        self.model_name = served["id"]
        self.mount(served, stores, model, settings)

    def mount(self, served: dict, stores: dict[str, MiloStore], model, settings: EngineSettings) -> None:
        """Load the tokenizer and mount the stores for planning (``served``: vLLM's /v1/models entry)."""
        directory = model_directory(model)
        config = read_config(directory)  # a refusal in one line, not transformers' exception
        check_supported(config)
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        for store in stores.values():
            check_compatible(store, config_identity(config, torch.float32))
        self.max_positions = min([served.get("max_model_len") or config.max_position_embeddings] +
                                 [s.meta["model"]["max_position_embeddings"] for s in stores.values()])
        rope = config_layer_rope_tables(config, self.max_positions)
        self.stores = {name: MountedStore(name, store, self.tokenizer, rope, "cpu", torch.float32, settings.aggregate,
                                          media=media_tokens(config)) for name, store in stores.items()}
        self.settings = settings

    def plan(self, store: str, request: Request) -> QueryPlan:
        """As `Engine.plan`: host-only, safe from any thread."""
        if store not in self.stores:
            raise KeyError(f"no store named {store!r} is mounted (mounted: {', '.join(self.stores)})")
        if request.recompute:
            raise RequestError("recompute is milo's own engine's: vLLM loads a stored prefix as it is")
        if request.sampling.logprobs is not None or request.grammar is not None or request.choices:
            raise RequestError("log probabilities and structured output are milo's own engine's: over --vllm, milo "
                               "forwards sampling and where the answer ends only (ask vLLM itself for these)")
        if request.ending.include_stop:
            raise RequestError("include_stop_str_in_output is milo's own engine's: vLLM would keep milo's template "
                               "markers too, which it sends as stop strings")
        return self.stores[store].plan(request, self.settings, self.max_positions)

    def prompt(self, plan: QueryPlan) -> VllmPrompt:
        m = self.stores[plan.store]
        return vllm_prompt(plan.store, m.store, plan.groups, plan.blocks, plan.query_ids, tuple(m.queries.task.labels))

    def request_body(self, plan: QueryPlan) -> dict:
        """The completions request vLLM answers ``plan`` with (not yet streamed)."""
        body = self.prompt(plan).body(self.model_name, max_tokens=plan.max_new_tokens)
        sampling = plan.request.sampling
        if not sampling.greedy or sampling.penalised:  # vLLM samples with the same settings (its own generator)
            body.update({"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or -1,
                         "min_p": sampling.min_p, "presence_penalty": sampling.presence_penalty,
                         "frequency_penalty": sampling.frequency_penalty,
                         "repetition_penalty": sampling.repetition_penalty})
            if sampling.seed is not None:
                body["seed"] = sampling.seed
        ending = plan.request.ending
        if ending != UNTIL_EOS:  # vLLM's own fields of these names
            body.update({"stop_token_ids": list(ending.stop_token_ids), "min_tokens": ending.min_tokens,
                         "ignore_eos": ending.ignore_eos, "skip_special_tokens": ending.skip_special_tokens})
        if not self.stores[plan.store].queries.task.labels:
            body["stop"] = list(STOP_STRINGS + tuple(plan.request.stop))
        return body

    def upstream_problem(self) -> str | None:
        """Why vLLM cannot answer now (its /health does not answer 200), or None; for milo's /health."""
        try:
            status = self.client.get("/health", timeout=HEALTH_TIMEOUT_S).status_code
        except httpx.HTTPError as e:
            return f"vLLM at {self.url} does not answer ({type(e).__name__}: {e})"
        return None if status == 200 else f"vLLM at {self.url}/health answered {status}"

    def batch(self) -> "VllmBatch":
        return VllmBatch(self)


@dataclass(eq=False)
class _Row:
    plan: QueryPlan
    started: float
    text: str = ""
    cancelled: bool = False
    first_token_seconds: float = 0.0
    usage: dict = field(default_factory=dict)


class VllmBatch:
    """The plans in flight on the vLLM server, each streamed by a thread of its own into one queue."""

    def __init__(self, engine: VllmEngine):
        self.engine = engine
        self.rows: dict[int, _Row] = {}
        self.events: queue.Queue = queue.Queue()
        self.fetch_stats: dict = {}  # vLLM's connector reads the blocks, not this process

    def __len__(self) -> int:
        return len(self.rows)  # a row leaves once it finished or was cancelled

    def idle(self) -> None:
        """vLLM's server keeps its own KV blocks: nothing is held here."""

    def held_counts(self) -> dict:
        return {}  # vLLM's server holds the K/V

    def admit(self, plans: list[QueryPlan]) -> list[RowEvent]:
        for plan in plans:
            row = _Row(plan, time.perf_counter())
            self.rows[id(plan)] = row
            threading.Thread(target=self._stream, args=(row,), daemon=True, name="milo-vllm-row").start()
        return []

    def cancel(self, plan: QueryPlan) -> None:
        row = self.rows.pop(id(plan), None)
        if row is not None:
            row.cancelled = True  # its thread closes the stream at its next chunk

    def step(self) -> list[RowEvent]:
        """The events that arrived: waits up to STEP_WAIT_S for the first, then takes whatever else is there."""
        items = []
        try:
            items.append(self.events.get(timeout=STEP_WAIT_S))
            while True:
                items.append(self.events.get_nowait())
        except queue.Empty:
            pass
        out = []
        for row, delta, reason, error in items:
            if row.cancelled:
                continue
            if error is not None:  # this row ends with the error; the others go on
                self.rows.pop(id(row.plan), None)
                out.append(RowEvent(row.plan, "", True, "error", error=error))
            else:
                out.append(self._event(row, delta, reason))
        return out

    def _event(self, row: _Row, delta: str, reason: str | None) -> RowEvent:
        if reason is None:
            return RowEvent(row.plan, delta, False)
        self.rows.pop(id(row.plan), None)
        p, usage = row.plan, row.usage
        prompt_tokens = usage.get("prompt_tokens", p.prompt_tokens)
        loaded = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        answer = Answer(text=row.text.strip(), blocks=p.blocks, groups=p.groups, prefix_tokens=p.prefix_tokens,
                        kv_bytes_full=p.placement.kv_bytes_full, kv_bytes_stored=p.placement.kv_bytes_stored,
                        seconds={"retrieve": p.retrieve_seconds, "vllm": time.perf_counter() - row.started},
                        completion_tokens=usage.get("completion_tokens", 0),
                        finish_reason="length" if reason == "length" else "stop",
                        first_token_seconds=p.retrieve_seconds + row.first_token_seconds,
                        prefill_tokens=prompt_tokens - loaded)
        return RowEvent(p, delta, True, answer.finish_reason, answer)

    def _stream(self, row: _Row) -> None:
        """One plan's streamed completion; every delta, the end, or the error goes to the queue."""
        e, p = self.engine, row.plan
        reason, done = None, False
        try:
            body = e.request_body(p)
            body.update(stream=True, stream_options={"include_usage": True})
            with e.client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise VllmUnavailable(f"vLLM at {e.url} answered {response.status_code}: {response.text[:500]}")
                for line in response.iter_lines():
                    if row.cancelled:
                        return
                    done = done or line == "data: [DONE]"
                    if not line.startswith("data: ") or done:
                        continue
                    chunk = self._frame(line[6:])
                    if chunk.get("usage"):
                        row.usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        if not row.text and choice.get("text"):
                            row.first_token_seconds = time.perf_counter() - row.started
                        row.text += choice.get("text") or ""
                        reason = choice.get("finish_reason") or reason
                        if reason == "error":
                            raise VllmUnavailable(f"vLLM at {e.url} ended the answer with finish_reason 'error'")
                        if choice.get("text"):
                            self.events.put((row, choice["text"], None, None))
            if not done:
                raise VllmUnavailable(f"vLLM at {e.url} ended the stream before its [DONE]: the answer is cut short")
            self.events.put((row, "", reason or "stop", None))
        except httpx.HTTPError as err:
            self.events.put((row, "", None, VllmUnavailable(f"vLLM at {e.url} failed mid-request ({err})")))
        except VllmUnavailable as err:
            self.events.put((row, "", None, err))
        except Exception as err:  # a bug, or an answer milo cannot read: this request ends, the others go on
            log.exception("streaming a request from vLLM at %s failed", e.url)
            failure = RowFailed(f"reading vLLM's answer failed: {type(err).__name__}: {err}")
            failure.__cause__ = err
            self.events.put((row, "", None, failure))

    def _frame(self, data: str) -> dict:
        """One SSE frame's JSON; vLLM's mid-stream error frame (``{"error": {...}}``) raises `VllmUnavailable`."""
        try:
            chunk = json.loads(data)
        except ValueError:
            raise VllmUnavailable(f"vLLM at {self.engine.url} sent a frame that is not JSON: {data[:200]!r}") from None
        if not isinstance(chunk, dict):
            raise VllmUnavailable(f"vLLM at {self.engine.url} sent a frame that is not an object: {data[:200]!r}")
        if "error" in chunk or chunk.get("object") == "error":
            error = chunk.get("error", chunk)
            message = error.get("message", error) if isinstance(error, dict) else error
            raise VllmUnavailable(f"vLLM at {self.engine.url} failed mid-stream: {message}")
        return chunk
