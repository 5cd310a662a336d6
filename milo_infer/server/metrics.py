"""Prometheus metrics of one server, under vLLM's names with a ``milo:`` prefix.

Each server has its own `CollectorRegistry` (never the process-wide one), so several apps can live
in one process, as the tests start them. Everything here is updated from the engine loop's thread;
prometheus_client's metrics are thread-safe.
"""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _BlockCacheHits:
    """Reads the block cache's own hit count at scrape time (a remote store's cached blocks)."""

    def __init__(self, block_cache):
        self.block_cache = block_cache

    def collect(self):
        family = CounterMetricFamily("milo:block_cache_hits", "Blocks of a store URL read from the local block cache")
        family.add_metric([], self.block_cache.hits if self.block_cache is not None else 0)
        yield family


class ServerMetrics:
    def __init__(self, block_cache=None):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("milo:num_requests_running", "Rows in the running batch", registry=r)
        self.waiting = Gauge("milo:num_requests_waiting", "Requests queued for a batch slot", registry=r)
        self.success = Counter("milo:request_success", "Finished requests by finish reason", ["finished_reason"],
                               registry=r)
        self.prompt_tokens = Counter("milo:prompt_tokens", "Prompt tokens (anchor, blocks and query) admitted",
                                     registry=r)
        self.generation_tokens = Counter("milo:generation_tokens", "Tokens generated", registry=r)
        self.e2e = Histogram("milo:e2e_request_latency_seconds", "From queueing to the last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("milo:time_to_first_token_seconds", "From queueing to the first event",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("milo:batch_size", "Rows in the batch at each decode step", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.kv_bytes_moved = Counter("milo:kv_bytes_moved", "Factor bytes fetched for admitted rows (shared blocks once)",
                                      registry=r)
        self.kv_bytes_stored = Counter("milo:kv_bytes_stored", "Factor bytes of admitted rows, each row counted alone",
                                       registry=r)
        self.unique_block_share = Gauge("milo:unique_block_share", "Unique blocks over requested blocks, last admission",
                                        registry=r)
        self.device_cache_hits = Counter("milo:device_cache_hits", "Blocks of admitted rows found in the device tier",
                                         registry=r)
        r.register(_BlockCacheHits(block_cache))

    def admitted(self, plans, fetch_stats: dict) -> None:
        self.prompt_tokens.inc(sum(p.prompt_tokens for p in plans))
        self.kv_bytes_stored.inc(sum(p.placement.kv_bytes_stored for p in plans))
        self.kv_bytes_moved.inc(fetch_stats.get("bytes", 0))
        self.device_cache_hits.inc(fetch_stats.get("device_hits", 0))
        if fetch_stats.get("blocks"):
            self.unique_block_share.set(fetch_stats["unique_blocks"] / fetch_stats["blocks"])

    def finished(self, answer, finish_reason: str, seconds: float) -> None:
        self.success.labels(finished_reason=finish_reason).inc()
        self.generation_tokens.inc(answer.completion_tokens)
        self.e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
