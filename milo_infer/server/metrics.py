"""Prometheus metrics of one server, under vLLM's names with a ``milo:`` prefix and vLLM's ``model_name`` label
(here the store a request names), so that a vLLM dashboard reads them once its prefix is changed.

Each server has its own `CollectorRegistry` (never the process-wide one), so several apps can live
in one process, as the tests start them; the process's own metrics (CPU, memory, file descriptors,
Python's version) are registered on it too. The engine loop's thread and the handlers update them;
prometheus_client's metrics are thread-safe. docs/design.md ("Serving") lists every metric.
"""
from collections import Counter as Tally

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector,
                               generate_latest)

# vLLM's latency buckets, from 1 ms: a label answer's first token can come within milliseconds
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TIERS = ("device", "memory", "block_cache", "disk", "object_store")  # where a block can be found, nearest first


def tier_reads(fetch_stats: dict) -> dict[str, int]:
    """The blocks an admission read (its union, each once), by the tier each was found in. The engine counts
    the device tier's, the memory tier's (the ``host`` tier and the ``cached`` tier's LRU), the block
    cache's hits and the blocks fetched from an object store; the rest came from the store's files."""
    found = {"device": fetch_stats.get("device_hits", 0), "memory": fetch_stats.get("memory_hits", 0),
             "block_cache": fetch_stats.get("block_cache_hits", 0),
             "object_store": fetch_stats.get("object_store_reads", 0)}
    found["disk"] = fetch_stats.get("unique_blocks", 0) - sum(found.values())
    return found


class ServerMetrics:
    def __init__(self, stores=()):
        r = self.registry = CollectorRegistry()
        M = ["model_name"]
        self.running = Gauge("milo:num_requests_running", "Rows in the running batch", M, registry=r)
        self.waiting = Gauge("milo:num_requests_waiting", "Requests queued for the batch", M, registry=r)
        self.success = Counter("milo:request_success", "Finished requests by finish reason",
                               M + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("milo:prompt_tokens", "Prompt tokens (anchor, blocks and query) admitted", M,
                                     registry=r)
        self.generation_tokens = Counter("milo:generation_tokens", "Tokens generated", M, registry=r)
        self.e2e = Histogram("milo:e2e_request_latency_seconds", "From the request's arrival to its last token", M,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("milo:time_to_first_token_seconds", "From the request's arrival to its first event", M,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("milo:request_queue_time_seconds", "From queueing to admission into the batch", M,
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("milo:inter_token_latency_seconds", "Between a row's successive events", M,
                                     buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("milo:batch_size", "Rows in the batch at each decode step", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.kv_bytes_moved = Counter("milo:kv_bytes_moved", "Factor bytes fetched to the device for admitted rows "
                                      "(shared blocks once, device-tier hits none)", registry=r)
        self.kv_bytes_stored = Counter("milo:kv_bytes_stored", "Factor bytes of admitted rows, each row counted alone",
                                       M, registry=r)
        self.unique_block_share = Gauge("milo:unique_block_share",
                                        "Unique blocks over requested blocks, last admission", registry=r)
        self.kv_bytes_held = Gauge("milo:kv_cache_bytes_held", "K/V bytes of the pages the running rows hold now: "
                                   "their own, and the blocks they place, each held once", registry=r)
        self.kv_bytes_kept = Gauge("milo:kv_cache_bytes_kept", "K/V bytes of held blocks no running row places, kept "
                                   "for the next rows until their pages are needed", registry=r)
        self.held_blocks = Gauge("milo:held_blocks", "Distinct blocks the running rows hold once, now", registry=r)
        self.placed_blocks = Gauge("milo:placed_blocks", "Blocks the running rows place (rows x k), now", registry=r)
        self.held_placements = Gauge("milo:held_placements", "Placements the running rows attend in a block held once "
                                     "(the others are in the rows' own pages), now", registry=r)
        self.factor_bytes_staged = Counter("milo:factor_bytes_staged", "Factor bytes staged on the device to rebuild "
                                           "admitted rows' blocks (a window layer's unreached blocks none)", registry=r)
        self.blocks_read = Counter("milo:blocks_read", "Blocks admissions read (shared blocks once), by the tier each "
                                   "was found in", ["tier"], registry=r)
        self.object_store_bytes = Counter("milo:object_store_bytes", "Bytes fetched from store URLs' object stores",
                                          registry=r)
        self.object_store_gets = Counter("milo:object_store_gets", "Range GETs sent to store URLs' object stores",
                                         registry=r)
        self.unreadable_blocks = Counter("milo:unreadable_blocks", "Blocks an admission could not read (failed "
                                         "checksum or read), each then computed or its rows failed", registry=r)
        self.recomputed_blocks = Counter("milo:recomputed_blocks", "Unreadable blocks the model computed for a row", M,
                                         registry=r)
        self.aborted = Counter("milo:request_aborted", "Requests whose client left before the answer", M, registry=r)
        self.reloads = Counter("milo:store_reloads", "New store versions found: swapped in, or failed to mount (the "
                               "old version kept serving)", M + ["result"], registry=r)
        self.warmup_seconds = Gauge("milo:warmup_seconds", "How long the start's warm-up took (0: none ran)",
                                    registry=r)
        self.compiled_after_warmup = Counter("milo:compiled_graphs_after_warmup", "Graphs torch.compile made after "
                                             "the warm-up, under traffic (shapes the warm-up never took)", registry=r)
        self.errors = Counter("milo:request_errors", "Requests answered with an error, by its code", ["code"],
                              registry=r)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.stores = list(stores)
        for store in self.stores:  # every store's series exist from the start, at 0
            for metric in (self.running, self.waiting, self.prompt_tokens, self.generation_tokens, self.kv_bytes_stored,
                           self.recomputed_blocks, self.aborted):
                metric.labels(store)
            for result in ("swapped", "failed"):
                self.reloads.labels(store, result)
        for tier in TIERS:
            self.blocks_read.labels(tier)

    def set_waiting(self, stores: Tally) -> None:
        for store in self.stores:
            self.waiting.labels(store).set(stores[store])

    def set_running(self, stores: Tally) -> None:
        for store in self.stores:
            self.running.labels(store).set(stores[store])

    def admitted(self, plans, fetch_stats: dict, queued_seconds: list[float]) -> None:
        """These plans joined the batch after queueing ``queued_seconds``; ``fetch_stats``: what it read."""
        for plan, seconds in zip(plans, queued_seconds):
            self.queue_time.labels(plan.store).observe(seconds)
            self.prompt_tokens.labels(plan.store).inc(plan.prompt_tokens)
            self.kv_bytes_stored.labels(plan.store).inc(plan.placement.kv_bytes_stored)
        self.kv_bytes_moved.inc(fetch_stats.get("bytes", 0))
        if fetch_stats.get("unique_blocks"):
            for tier, blocks in tier_reads(fetch_stats).items():
                self.blocks_read.labels(tier).inc(blocks)
        self.factor_bytes_staged.inc(fetch_stats.get("staged_bytes", 0))
        self.object_store_bytes.inc(fetch_stats.get("remote_bytes", 0))
        self.object_store_gets.inc(fetch_stats.get("remote_gets", 0))
        self.unreadable_blocks.inc(fetch_stats.get("unreadable_blocks", 0))
        if fetch_stats.get("blocks"):
            self.unique_block_share.set(fetch_stats["unique_blocks"] / fetch_stats["blocks"])

    def held(self, counts: dict) -> None:
        """The running batch's `held_counts` (none: another process holds the K/V)."""
        for name, gauge in (("kv_bytes_held", self.kv_bytes_held), ("kv_bytes_kept", self.kv_bytes_kept),
                            ("held_blocks", self.held_blocks), ("placed_blocks", self.placed_blocks),
                            ("held_placements", self.held_placements)):
            if name in counts:
                gauge.set(counts[name])

    def finished(self, store: str, answer, finish_reason: str, seconds: float) -> None:
        self.success.labels(store, finish_reason).inc()
        self.generation_tokens.labels(store).inc(answer.completion_tokens)
        self.recomputed_blocks.labels(store).inc(len(answer.recomputed_blocks))
        self.e2e.labels(store).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
