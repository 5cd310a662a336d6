"""The engine loop: one thread owns the engine's running batch; HTTP handlers only submit plans and read events.

Continuous batching: each iteration admits waiting requests into the batch (it holds at most ``max_batch``
rows; an empty batch waits up to ``batch_wait_s`` for more to gather), then runs one decode step for every
row. A finished row leaves the batch at once, so a waiting request joins at the next step and a short label
answer is never held behind a long free-form one. The engine seats an admitted row once its KV pages fit
and keeps it waiting until then, counted in ``len(batch)``, so the loop takes no more from the queue than
``max_batch`` rows in all: beyond them requests wait in the queue, and a full queue refuses (`QueueFull`).

Each request's ``deliver`` is called on the loop's thread with every `RowEvent` of its row, or with
one exception that ends it (`EngineFailed`, `ShuttingDown`, an engine `RequestError`): every
submitted request that was not cancelled gets a finished event or an error, whatever fails when.

What fails, fails as little as it can: an admission that raises fails the requests it was admitting
(the running rows go on; if it left the batch broken, that batch's next step fails); a step that
raises fails the rows of its batch, and the loop goes on with a fresh batch; only a loop that cannot
go on (``engine.batch()`` raising) fails everything it holds, marks itself failed (``failure``) and
takes no more requests, so that the server exits non-zero and a supervisor restarts it.
"""
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from ..runtime.attention import compiled_graphs
from ..runtime.interface import RowEvent, ServingEngine
from ..runtime.errors import RequestError
from ..runtime.planning import QueryPlan
from .metrics import ServerMetrics

log = logging.getLogger("milo.serve")
IDLE_POLL_S = 0.05  # how often an idle loop looks whether it was told to stop


class QueueFull(Exception):
    """Every queue slot is taken: the client should retry later (503 with Retry-After)."""


class NotAccepting(Exception):
    """The loop has ended (stopped, or failed for good): it takes no new requests."""


class EngineFailed(RuntimeError):
    """The engine raised while admitting or running this request (the message names what it raised)."""


class ShuttingDown(RuntimeError):
    """The server stopped before this request was answered."""


@dataclass(eq=False)
class Ticket:
    """One submitted request, as the loop tracks it."""

    plan: QueryPlan
    deliver: Callable[[object], None]
    arrived: float  # when its HTTP request came (time.monotonic), before it was read, planned and queued
    submitted: float = field(default_factory=time.monotonic)
    answered: bool = False  # its first event was delivered
    last_event: float = 0.0  # when its latest event came (time.monotonic)
    cancelled: bool = False


class EngineLoop:
    def __init__(self, engine: ServingEngine, metrics: ServerMetrics, *, max_batch: int = 16, batch_wait_s: float = 0.005,
                 max_queue: int = 256, warmup: Callable[[], dict] | None = None):
        if max_batch < 1 or max_queue < 1 or batch_wait_s < 0:
            raise ValueError(f"max_batch and max_queue must be at least 1 and batch_wait_s not negative; got "
                             f"{max_batch}, {max_queue}, {batch_wait_s}")
        self.engine, self.metrics = engine, metrics
        self.max_batch, self.batch_wait_s = max_batch, batch_wait_s
        self.waiting: queue.Queue[Ticket] = queue.Queue(max_queue)
        self.failure: str | None = None  # why the loop could not go on, once it could not
        self.draining = False  # /health answers 503; the app refuses new requests, those it holds go on
        self._cancelled: queue.SimpleQueue[Ticket] = queue.SimpleQueue()
        self._running: dict[int, Ticket] = {}  # id(plan) -> ticket; the ticket keeps the plan (and its id) alive
        self._lock = threading.Lock()  # a submit's check and enqueue against the loop's closing: nothing is
        self._closed = False  # queued once the loop has ended what it held
        self._held = 0  # tickets submitted and not yet answered (or dropped, their client gone)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="milo-engine-loop", daemon=True)
        self._counted_fetch_stats: dict | None = None  # the batch's fetch_stats the metrics last counted
        self.warmup = warmup  # run on the loop's thread before its first batch (`milo_infer.server.warmup`)
        self.warming = warmup is not None  # /health answers 503 "warming"; requests queue meanwhile
        self._graphs = compiled_graphs()  # compiles counted so far (those after warming go to the metrics)

    @property
    def healthy(self) -> bool:
        return self.failure is None and not self.draining and not self.warming and self._thread.is_alive()

    @property
    def idle(self) -> bool:
        """Every request submitted so far has been answered (or its client left)."""
        return self._held == 0

    def start(self) -> None:
        self._thread.start()

    def drain(self) -> None:
        """Start draining: ``healthy`` turns false; what is queued or running goes on."""
        self.draining = True

    def stop(self, timeout: float | None = None) -> None:
        """End the loop (after the step under way), waiting up to ``timeout`` for it: what is still queued or
        running gets `ShuttingDown`, and later submits `NotAccepting`."""
        self.draining = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, plan: QueryPlan, deliver: Callable[[object], None], arrived: float | None = None) -> Ticket:
        """Queue a plan (from any thread) whose request came at ``arrived`` (time.monotonic; default now), from
        when its latencies are measured; raises `QueueFull` or `NotAccepting`."""
        return self.submit_all([plan], [deliver], arrived)[0]

    def submit_all(self, plans: list[QueryPlan], delivers: list[Callable[[object], None]],
                   arrived: float | None = None) -> list[Ticket]:
        """Queue the rows of one request (its n answers) together, all or none, one after the other: the loop
        admits them in one batch when they fit, so their blocks are read and held once."""
        arrived = time.monotonic() if arrived is None else arrived
        tickets = [Ticket(plan, deliver, arrived) for plan, deliver in zip(plans, delivers)]
        with self._lock:
            if self.failure is not None:
                raise NotAccepting(f"the engine failed: {self.failure}")
            if self._closed:
                raise NotAccepting("the server is shutting down")
            with self.waiting.mutex:  # only submits add to the queue, and they hold self._lock
                free = self.waiting.maxsize - len(self.waiting.queue)
            if len(tickets) > free:
                raise QueueFull(f"{free} of the {self.waiting.maxsize} queue slots are free, {len(tickets)} asked")
            for ticket in tickets:
                self.waiting.put_nowait(ticket)
            self._held += len(tickets)
        self._report_waiting()
        return tickets

    def cancel(self, ticket: Ticket) -> None:
        """The client left (from any thread): its row leaves the batch at the next iteration."""
        ticket.cancelled = True
        self._cancelled.put(ticket)

    def _report_waiting(self) -> None:
        """The waiting gauge, counted and set under the queue's lock (from any thread: the last set is never stale)."""
        with self.waiting.mutex:
            self.metrics.set_waiting(Counter(t.plan.store for t in self.waiting.queue))

    # -- the loop's own thread ----------------------------------------------------------------------
    def _run(self) -> None:
        ending: Exception = ShuttingDown("the server stopped before this request was answered")
        try:
            self._warm()
            batch = self.engine.batch()
            while not self._stop.is_set():
                if not self._iterate(batch):
                    batch = self.engine.batch()
        except Exception as e:  # no batch can be made: nothing more can be answered
            self.failure = f"{type(e).__name__}: {e}"
            log.exception("the engine loop cannot go on; every request it holds fails")
            ending = EngineFailed(f"the engine failed: {self.failure}")
        finally:
            self._end_all(ending)
            self.metrics.set_running(Counter())
            self.metrics.set_waiting(Counter())

    def _warm(self) -> None:
        """Run the warm-up (a failure is logged: traffic may still be served, only slower at first), then count
        compiles from here on."""
        try:
            if self.warmup is not None:
                result = self.warmup()
                self.metrics.warmup_seconds.set(result["seconds"])
        except Exception:
            log.exception("the warm-up failed; the server starts unwarmed")
        finally:
            self._graphs = compiled_graphs()
            self.warming = False

    def _count_compiles(self) -> None:
        """Graphs compiled since the last count (shapes the warm-up never took) go to the metrics."""
        graphs = compiled_graphs()
        if graphs > self._graphs:
            self.metrics.compiled_after_warmup.inc(graphs - self._graphs)
            self._graphs = graphs

    def _iterate(self, batch) -> bool:
        """Drop cancelled rows, admit queued plans up to ``max_batch`` rows, one decode step. False when the batch
        raised: its rows were answered with the error, and the batch is done for."""
        try:
            self._drop_cancelled(batch)
            tickets = self._take(self.max_batch - len(batch), idle=len(batch) == 0)
            if tickets:
                self._admit(batch, tickets)
            if len(batch):
                self.metrics.batch_size.observe(len(batch))
                self._deliver(batch.step())
            elif not tickets:  # idle for a poll: the held blocks no row holds go (the K/V pools stay)
                batch.idle()
            self.metrics.held(batch.held_counts())
            return True
        except Exception as e:
            log.exception("a batch of %d request(s) failed; they fail, the loop goes on with a new batch",
                          len(self._running))
            self._end_running(EngineFailed(f"the engine failed while running this request: {type(e).__name__}: {e}"))
            return False
        finally:
            self.metrics.set_running(Counter(t.plan.store for t in self._running.values()))
            self._report_waiting()
            self._count_compiles()

    def _take(self, free: int, *, idle: bool) -> list[Ticket]:
        """Up to ``free`` queued tickets, not cancelled; an idle loop blocks for the first, then gathers."""
        taken: list[Ticket] = []
        if free <= 0:
            return taken
        if idle:
            try:
                taken.append(self.waiting.get(timeout=IDLE_POLL_S))
            except queue.Empty:
                return taken
        deadline = time.monotonic() + (self.batch_wait_s if idle else 0.0)
        while len(taken) < free:
            remaining = deadline - time.monotonic()
            try:
                taken.append(self.waiting.get(timeout=remaining) if remaining > 0 else self.waiting.get_nowait())
            except queue.Empty:
                break
        if taken:  # not only after the step: a waiting gauge left at 1 through a long step would be wrong
            self._report_waiting()
        kept = [t for t in taken if not t.cancelled]
        for t in taken:
            if t.cancelled:
                self.metrics.aborted.labels(t.plan.store).inc()
        self._release(len(taken) - len(kept))
        return kept

    def _admit(self, batch, tickets: list[Ticket]) -> None:
        now = time.monotonic()
        try:
            events = batch.admit([t.plan for t in tickets])
        except RequestError as e:  # the plans cannot be served; the batch itself is fine
            self._answer(tickets, e)
            return
        except Exception as e:  # these plans broke their admission; the rows already running go on
            log.exception("admitting %d request(s) failed; they fail, the batch goes on", len(tickets))
            self._answer(tickets, EngineFailed(f"the engine failed to admit this request: {type(e).__name__}: {e}"))
            return
        for t in tickets:
            self._running[id(t.plan)] = t
        # an admission whose every row failed before reading leaves the last admission's fetch_stats in place
        fetch_stats = batch.fetch_stats if batch.fetch_stats is not self._counted_fetch_stats else {}
        self._counted_fetch_stats = batch.fetch_stats
        self.metrics.admitted([t.plan for t in tickets], fetch_stats, [now - t.submitted for t in tickets])
        self._deliver(events)

    def _deliver(self, events: list[RowEvent]) -> None:
        now = time.monotonic()
        for event in events:
            ticket = self._running.get(id(event.plan))
            if ticket is None:  # a cancelled row's last event
                continue
            if event.error is not None:  # this row failed (in another engine); the batch goes on
                del self._running[id(event.plan)]
                self._answer([ticket], event.error)
                continue
            store = ticket.plan.store
            if not ticket.answered:
                ticket.answered = True
                self.metrics.ttft.labels(store).observe(now - ticket.arrived)
            elif event.delta:
                self.metrics.inter_token.labels(store).observe(now - ticket.last_event)
            ticket.last_event = now
            if event.finished:
                del self._running[id(event.plan)]
                self.metrics.finished(store, event.answer, event.finish_reason, now - ticket.arrived)
                self._answer([ticket], event)
            else:
                ticket.deliver(event)

    def _drop_cancelled(self, batch) -> None:
        while True:
            try:
                ticket = self._cancelled.get_nowait()
            except queue.Empty:
                return
            if self._running.pop(id(ticket.plan), None) is ticket:
                self.metrics.aborted.labels(ticket.plan.store).inc()
                self._release(1)
                batch.cancel(ticket.plan)

    def _answer(self, tickets: list[Ticket], last) -> None:
        """The last thing these requests get (their finished event, or the error that ends them)."""
        for ticket in tickets:
            if not ticket.cancelled:
                ticket.deliver(last)
        self._release(len(tickets))

    def _release(self, n: int) -> None:
        with self._lock:
            self._held -= n

    def _end_running(self, error: Exception) -> None:
        """Tell every running request that it ends with ``error``."""
        ended = list(self._running.values())
        self._running.clear()
        self._answer(ended, error)

    def _end_all(self, error: Exception) -> None:
        """Take no more requests, and tell every running and queued one that it ends with ``error``."""
        with self._lock:
            self._closed = True
        self._end_running(error)
        queued = []
        while True:
            try:
                queued.append(self.waiting.get_nowait())
            except queue.Empty:
                break
        self._answer(queued, error)
