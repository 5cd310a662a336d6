"""The HTTP layer: thin FastAPI handlers over one `EngineLoop`, speaking OpenAI's completions API.

The handlers live on a module-level `router` and read the engine, its loop and the settings from
``request.app.state``, which `create_app` fills (as vLLM's OpenAI server does). A handler reads and
checks the body, makes the query's plan on a worker thread (retrieval and tokenising run on the host,
never the model), queues it, and awaits its row's events, which the loop's thread hands over with
``call_soon_threadsafe`` into the request's own asyncio queue. Only the stores the server was
started with are served: a ``model`` names one of them, never a path. Every error, the framework's
own included, answers in OpenAI's error shape.
"""
import asyncio
import hmac
import threading
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runtime.errors import AdmissionOutOfMemory, BlockLoadError, RequestError, UpstreamError
from ..runtime.planning import answers_of
from . import MAX_BODY_BYTES, protocol
from .metrics import ServerMetrics
from .protocol import APIError, ChunkWriter, ParsedRequest
from .reload import StoreReloader
from .scheduler import EngineLoop, NotAccepting, QueueFull, ShuttingDown

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request looks whether its client left
STOP_TIMEOUT_S = 10.0


class ClientGone(Exception):
    """The client of a non-streamed request disconnected while it waited."""


def shutting_down(message: str) -> APIError:
    return APIError(503, message, kind="server_error", code="shutting_down")


def as_api_error(error: Exception) -> APIError:
    """The HTTP error of an exception the engine loop ended a request with."""
    if isinstance(error, RequestError):
        return APIError(400, str(error), code="invalid_request")
    if isinstance(error, ShuttingDown):
        return shutting_down(str(error))
    if isinstance(error, UpstreamError):
        return APIError(502, str(error), kind="server_error", code="upstream_failed")
    if isinstance(error, AdmissionOutOfMemory):
        return APIError(503, str(error), kind="server_error", code="out_of_memory",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(error, BlockLoadError):
        return APIError(500, str(error), kind="server_error", code="block_unreadable")
    return APIError(500, str(error), kind="server_error", code="engine_failed")


def count_error(metrics: ServerMetrics, error: APIError) -> None:
    metrics.errors.labels(error.code or str(error.status)).inc()


async def read_body(request: HTTPRequest, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed ``limit`` bytes."""
    too_large = APIError(413, f"the body exceeds the server's limit of {limit} bytes", code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def require_key(request: HTTPRequest) -> None:
    """The bearer key, when the server has one, compared in constant time."""
    api_key = request.app.state.api_key
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())):
        raise APIError(401, "a missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


router = APIRouter()
"""Every route of the server; each reads what it needs from ``request.app.state`` (built by `create_app`)."""
KEYED = [Depends(require_key)]  # every route but /health


@router.get("/health")
async def health(request: HTTPRequest):
    """200 ``ok``; 503 ``warming`` (the start's warm-up is compiling: `milo_infer.server.warmup`), ``failed``
    (the engine loop cannot go on), ``draining``, or ``degraded`` with a ``detail`` when the engine forwards to
    a server that does not answer (``upstream_problem``, vLLM's)."""
    state = request.app.state
    loop = state.engine_loop
    if loop.warming and loop.failure is None and not loop.draining:
        return JSONResponse({"status": "warming"}, status_code=503)
    if not loop.healthy:
        return JSONResponse({"status": "failed" if loop.failure else "draining"}, status_code=503)
    upstream_problem = getattr(state.engine, "upstream_problem", None)
    problem = await run_in_threadpool(upstream_problem) if upstream_problem else None
    if problem:
        return JSONResponse({"status": "degraded", "detail": problem}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics", dependencies=KEYED)
async def prometheus(request: HTTPRequest):
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", dependencies=KEYED)
async def models(request: HTTPRequest):
    """OpenAI's model list, one entry per store, with the store version that answers new requests, its system
    prompt (a chat whose system message is this one is answered exactly as the store was built) and, for a label
    store, its labels and a ``response_format`` whose JSON schema's enum they are (a client sends it back to have
    every answer be one of them, as JSON)."""
    state = request.app.state
    return {"object": "list", "data": [{"id": name, "object": "model", "created": state.started, "owned_by": "milo",
                                        "version": mounted.version, **protocol.store_card(mounted)}
                                       for name, mounted in state.engine.stores.items()]}


@router.post("/admin/reload", dependencies=KEYED)
async def reload_stores(request: HTTPRequest):
    """Swap in the stores' new versions now (the body may name one: ``{"model": name}``): 200 with each store's
    version (and the one it replaced), or 500 ``reload_failed`` naming every store whose new version could
    not be mounted, which keep serving their old one."""
    state = request.app.state
    if state.reloader is None:
        raise APIError(400, "this server does not swap store versions (over vLLM, the connector keeps the versions it "
                            "mounted at its start: restart vLLM, then milo serve, to serve a new version)",
                       code="unsupported")
    raw = await read_body(request, state.max_body_bytes)
    body = protocol.parse_json(raw) if raw.strip() else {}
    if unknown := sorted(set(body) - {"model"}):
        raise protocol.invalid(unknown[0], "is not a field of /admin/reload (it takes only 'model')")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise protocol.invalid("model", f"must be a store's name, got {model!r}")
    if model is not None and model not in state.engine.stores:
        raise APIError(404, f"model {model!r} is not mounted here; mounted: {', '.join(sorted(state.engine.stores))}",
                       param="model", code="model_not_found")
    looked = await run_in_threadpool(state.reloader.reload, [model] if model else None)
    failed = [r for r in looked if r.error]
    if failed:
        raise APIError(500, "; ".join(f"store {r.store!r}: {r.error}" for r in failed), kind="server_error",
                       code="reload_failed")
    return {"object": "list", "data": [{"id": r.store, "version": r.version, "previous": r.previous} for r in looked]}


@router.post("/v1/completions", dependencies=KEYED)
async def completions(request: HTTPRequest):
    return await answer(request, chat=False)


@router.post("/v1/chat/completions", dependencies=KEYED)
async def chat_completions(request: HTTPRequest):
    return await answer(request, chat=True)


async def answer(request: HTTPRequest, chat: bool):
    """Check the body, plan on a worker thread, queue the plan, and answer from its row's events. A request
    that came before the server started draining is ``preparing`` until queued, so that the drain waits
    for it too."""
    arrived = time.monotonic()
    state = request.app.state
    if state.engine_loop.draining:
        raise shutting_down("the server is shutting down")
    state.preparing += 1
    try:
        parsed, plan, tickets, events = await prepare(request, chat, arrived)
    finally:
        state.preparing -= 1
    loop, tokenizer = state.engine_loop, getattr(state.engine, "tokenizer", None)
    if parsed.stream:
        return StreamingResponse(stream(loop, state.metrics, parsed, plan, tickets, events, tokenizer),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        answers = await last_events(request, events, parsed.n)
    except ClientGone:
        return Response(status_code=499)
    finally:
        for ticket in tickets:
            loop.cancel(ticket)  # a no-op for a finished row
    return protocol.completion(parsed, plan, answers, tokenizer)


async def prepare(request: HTTPRequest, chat: bool, arrived: float):
    """The checked body, its plan, the tickets of its n rows in the engine loop, and the queue their events come
    to, each as (answer index, event)."""
    state = request.app.state
    engine, loop = state.engine, state.engine_loop
    body = protocol.parse_json(await read_body(request, state.max_body_bytes))
    parsed = protocol.parse_request(body, chat=chat, models=engine.stores, max_positions=engine.max_positions)
    if parsed.n > loop.waiting.maxsize:
        raise protocol.invalid("n", f"must be at most {loop.waiting.maxsize}: the server queues that many rows at most")
    try:
        plan = await run_in_threadpool(plan_query, state, parsed)
    except RequestError as e:
        raise APIError(400, str(e), code="invalid_request") from None
    events: asyncio.Queue = asyncio.Queue()
    event_loop = asyncio.get_running_loop()

    def deliver(index: int):
        def put(item) -> None:  # on the engine loop's thread
            try:
                event_loop.call_soon_threadsafe(events.put_nowait, (index, item))
            except RuntimeError:  # the event loop has closed: nobody waits for this any more
                pass
        return put

    try:
        rows = answers_of(plan, parsed.n)
        tickets = loop.submit_all(rows, [deliver(i) for i in range(len(rows))], arrived)
    except QueueFull as e:
        raise APIError(503, f"the server is busy ({e}); retry later", kind="server_error", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except NotAccepting as e:
        if loop.failure is None:
            raise shutting_down(str(e)) from None
        raise APIError(503, str(e), kind="server_error", code="unavailable") from None
    return parsed, plan, tickets, events


def plan_query(state, parsed: ParsedRequest):
    """The request's plan, made on a worker thread, one at a time: planning encodes the query with the model's
    one fast tokenizer, and tokenizers releases before 0.23.1 raise 'Already borrowed' when transformers
    reconfigures it (truncation, padding) on one thread while another thread encodes. The engine loop only
    decodes with it, which takes the GIL throughout, so serialising the planners is enough."""
    with state.planning:
        return state.engine.plan(parsed.model, parsed.request)


async def last_events(request: HTTPRequest, events: asyncio.Queue, n: int):
    """The answers of the request's ``n`` rows, in order, looking every DISCONNECT_POLL_S whether the client is still
    there; the first row that fails fails the request."""
    async def finishing():
        answers = {}
        while len(answers) < n:
            index, item = await events.get()
            if isinstance(item, Exception):
                raise as_api_error(item)
            if item.finished:
                answers[index] = item.answer
        return [answers[i] for i in range(n)]

    waiter = asyncio.ensure_future(finishing())
    while not (await asyncio.wait({waiter}, timeout=DISCONNECT_POLL_S))[0]:
        if await request.is_disconnected():
            waiter.cancel()
            raise ClientGone
    return waiter.result()


async def stream(loop: EngineLoop, metrics: ServerMetrics, parsed: ParsedRequest, plan, tickets,
                 events: asyncio.Queue, tokenizer=None):
    """SSE frames of the request's rows, each chunk naming its answer's index; a client that leaves cancels the
    generator, and so its rows. The first row that fails ends the stream with its error."""
    writer, answers = ChunkWriter(parsed, tokenizer), {}
    try:
        while len(answers) < parsed.n:
            index, item = await events.get()
            if isinstance(item, Exception):
                error = as_api_error(item)
                count_error(metrics, error)
                yield writer.error(error)
                break
            frame = writer.event(index, item.delta, item.finish_reason if item.finished else None, item.logprobs)
            if frame is not None:
                yield frame
            if item.finished:
                answers[index] = item.answer
        else:
            if parsed.include_usage:
                yield writer.usage_chunk(plan, [answers[i] for i in range(parsed.n)])
        yield writer.done()
    finally:
        for ticket in tickets:
            loop.cancel(ticket)


@asynccontextmanager
async def lifespan(app: FastAPI):
    loop, reloader = app.state.engine_loop, app.state.reloader
    loop.start()
    if reloader is not None:
        reloader.start()
    yield
    if reloader is not None:
        await run_in_threadpool(reloader.stop)
    await run_in_threadpool(loop.stop, STOP_TIMEOUT_S)


def error_response(request: HTTPRequest, error: APIError) -> JSONResponse:
    """``error`` in OpenAI's shape, counted by its code; a 4xx says ``x-should-retry: false`` (the openai client
    would retry a 408, 409 or 429 by itself): the same request can only fail again."""
    count_error(request.app.state.metrics, error)
    headers = dict(error.headers)
    if 400 <= error.status < 500:
        headers["x-should-retry"] = "false"
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def api_error(request: HTTPRequest, error: APIError):
    return error_response(request, error)


async def http_error(request: HTTPRequest, error: StarletteHTTPException):
    """Starlette's own errors (an unknown route, a method a route does not take) in OpenAI's shape."""
    method, path = request.method, request.url.path
    message, code = {404: (f"no route {method} {path}", "not_found"),
                     405: (f"{method} is not allowed on {path}", "method_not_allowed")
                     }.get(error.status_code, (str(error.detail), None))
    return error_response(request, APIError(error.status_code, message, code=code, headers=error.headers))


async def internal_error(request: HTTPRequest, error: Exception):
    """A bug's 500, in OpenAI's shape (Starlette still raises it on, so uvicorn logs its traceback)."""
    return error_response(request, APIError(500, f"the server failed on this request ({type(error).__name__}); its "
                                                 f"log has the details", kind="server_error", code="internal_error"))


def create_app(engine, *, api_key: str | None = None, max_batch: int = 16, batch_wait_ms: float = 5.0,
               max_queue: int = 256, max_body_bytes: int = MAX_BODY_BYTES, locations: dict[str, str] | None = None,
               open_store=None, reload_interval_s: float = 0.0, warmup=None) -> FastAPI:
    """An app serving ``engine``'s mounted stores; its engine loop starts and stops with the app's lifespan.
    ``app.state.engine_loop.drain()`` starts draining: ``/health`` and new requests answer 503 from then on.
    With ``locations`` (each store's directory or URL, by name) and ``open_store`` (opens one), the stores
    are hot-swapped to their new versions (`reload.StoreReloader`): every ``reload_interval_s`` seconds
    (0: never by itself) and on ``POST /admin/reload``; without, that endpoint answers 400. ``warmup`` (a
    callable returning {"seconds": ...}) runs on the engine loop's thread first; ``/health`` answers 503
    ``warming`` until it ends, and requests queue meanwhile."""
    app = FastAPI(title="milo serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    state = app.state
    state.engine, state.api_key, state.max_body_bytes, state.started = engine, api_key, max_body_bytes, int(time.time())
    state.preparing = 0  # requests being read, checked or planned, not yet queued (on the event loop's thread)
    state.planning = threading.Lock()  # one plan at a time (`plan_query`)
    state.metrics = ServerMetrics(engine.stores)
    state.reloader = (StoreReloader(engine, locations, open_store, state.metrics, reload_interval_s, state.planning)
                      if locations is not None else None)
    state.engine_loop = EngineLoop(engine, state.metrics, max_batch=max_batch, batch_wait_s=batch_wait_ms / 1000,
                                   max_queue=max_queue, warmup=warmup)
    app.include_router(router)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    return app
