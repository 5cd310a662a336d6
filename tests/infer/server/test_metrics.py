"""`milo serve`'s /metrics move as a Grafana user reading vLLM's dashboards expects: exact counts where the fake
engine makes them known, latencies measured from the request's arrival."""
import asyncio
import time

import httpx
import openai

from milo_infer.server.metrics import ServerMetrics
from tests.infer.server.fake_engine import FakeEngine, expected_answer
from tests.infer.server.serving import metric, serving

DEMO = '{model_name="demo"}'


def test_sequential_requests_move_every_counter_exactly():
    """One request at a time, so each is one admission: every count is known from the fake's answers."""
    queries = ["where is my card", "one two three four five six seven eight nine ten", "hi", "damaged block here"]
    with serving(FakeEngine()) as served:
        client = openai.OpenAI(base_url=served.base + "/v1", api_key="x", max_retries=0, timeout=10)
        for q in queries[:2]:
            client.completions.create(model="demo", prompt=q)
        for q in queries[2:]:
            list(client.completions.create(model="demo", prompt=q, stream=True))
        answers = [expected_answer(q) for q in queries]
        words = [len(a.split()) for a, _ in answers]
        m = lambda name: metric(served.base, name)  # noqa: E731
        assert m('milo:request_success_total{finished_reason="stop",model_name="demo"}') == 3
        assert m('milo:request_success_total{finished_reason="length",model_name="demo"}') == 1
        assert m("milo:generation_tokens_total" + DEMO) == sum(words)
        assert m("milo:prompt_tokens_total" + DEMO) == sum(10 + len(q.split()) for q in queries)
        assert m("milo:kv_bytes_stored_total" + DEMO) == 100 * len(queries)
        for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
            assert m(f"milo:{histogram}_seconds_count" + DEMO) == len(queries), histogram
        assert m("milo:inter_token_latency_seconds_count" + DEMO) == sum(n - 1 for n in words)  # one token a step
        assert m('milo:blocks_read_total{tier="device"}') == len(queries)  # the fake: one of its two blocks
        assert m('milo:blocks_read_total{tier="disk"}') == len(queries)
        assert m('milo:blocks_read_total{tier="object_store"}') == 0
        assert m("milo:kv_bytes_moved_total") == 200 * len(queries)
        assert m("milo:unreadable_blocks_total") == 1 and m("milo:recomputed_blocks_total" + DEMO) == 1
        assert m("milo:request_aborted_total" + DEMO) == 0
        assert m('milo:num_requests_running' + DEMO) == 0 and m('milo:num_requests_waiting' + DEMO) == 0


def test_latencies_start_at_the_requests_arrival():
    """Planning (retrieval, tokenising) takes 60 ms here: time to first token and end-to-end latency include it,
    queue time does not."""
    with serving(FakeEngine(plan_s=0.06), batch_wait_ms=0) as served:
        httpx.post(served.base + "/v1/completions", json={"model": "demo", "prompt": "a b c"}, timeout=10)
        m = lambda name: metric(served.base, name)  # noqa: E731
        for histogram in ("time_to_first_token", "e2e_request_latency"):
            assert m(f'milo:{histogram}_seconds_bucket{{le="0.05",model_name="demo"}}') == 0, histogram
            assert m(f"milo:{histogram}_seconds_sum" + DEMO) >= 0.06, histogram
        assert m('milo:request_queue_time_seconds_bucket{le="0.05",model_name="demo"}') == 1
        assert m('milo:time_to_first_token_seconds_bucket{le="0.001",model_name="demo"}') == 0  # buckets from 1 ms


def test_errors_by_code_queue_full_refusals_and_aborts_are_counted():
    engine = FakeEngine(step_s=0.02)
    with serving(engine, max_batch=1, max_queue=1, batch_wait_ms=0) as served:
        base = served.base
        assert httpx.post(base + "/v1/completions", json={"model": "nope", "prompt": "hi"}).status_code == 404
        assert httpx.post(base + "/v1/completions", json={"model": "demo", "prompt": "hi", "n": 17}).status_code == 400
        assert httpx.get(base + "/v1/nothing").status_code == 404
        with httpx.stream("POST", base + "/v1/completions", timeout=10,
                          json={"model": "demo", "prompt": "w crash", "stream": True}) as r:
            assert r.status_code == 200 and '"code": "engine_failed"' in r.read().decode()  # a mid-stream error

        async def burst():
            async with httpx.AsyncClient(timeout=20) as http:
                return await asyncio.gather(*(http.post(base + "/v1/completions", json={
                    "model": "demo", "prompt": "w " * 8}) for _ in range(6)))

        refused = sum(r.status_code == 503 for r in asyncio.run(burst()))
        with httpx.stream("POST", base + "/v1/completions", timeout=10,
                          json={"model": "demo", "prompt": "w " * 30, "max_tokens": 30, "stream": True}) as r:
            next(r.iter_lines())  # running; the client leaves
        deadline = time.monotonic() + 5
        while metric(base, "milo:request_aborted_total" + DEMO) != 1:
            assert time.monotonic() < deadline, "the abort was not counted"
            time.sleep(0.02)
        m = lambda code: metric(base, f'milo:request_errors_total{{code="{code}"}}')  # noqa: E731
        assert (m("model_not_found"), m("invalid_value"), m("not_found"), m("engine_failed")) == (1, 1, 1, 1)
        assert refused > 0 and m("queue_full") == refused


def test_block_reads_are_counted_by_the_tier_that_held_them():
    """An admission of 10 unique blocks: 1 in the device tier, 2 in memory, 3 in the block cache, 1 from the
    object store; the other 3 came from the store's files."""
    metrics = ServerMetrics(["demo"])
    metrics.admitted([], {"blocks": 12, "unique_blocks": 10, "device_hits": 1, "memory_hits": 2, "block_cache_hits": 3,
                          "object_store_reads": 1, "remote_bytes": 4096, "remote_gets": 2, "unreadable_blocks": 1}, [])
    value = metrics.registry.get_sample_value
    assert {tier: value("milo:blocks_read_total", {"tier": tier}) for tier in
            ("device", "memory", "block_cache", "disk", "object_store")} == {
        "device": 1, "memory": 2, "block_cache": 3, "disk": 3, "object_store": 1}
    assert value("milo:object_store_bytes_total") == 4096 and value("milo:object_store_gets_total") == 2
    assert value("milo:unreadable_blocks_total") == 1
    assert value("milo:num_requests_running", {"model_name": "demo"}) == 0


def test_kv_held_and_blocks_held_against_placed_are_the_running_batchs():
    """While a row decodes, the gauges are its batch's `held_counts`; once it leaves, they fall to nothing."""
    with serving(FakeEngine(step_s=0.02), batch_wait_ms=0) as served:
        m = lambda name: metric(served.base, name)  # noqa: E731
        with httpx.stream("POST", served.base + "/v1/completions", timeout=10,
                          json={"model": "demo", "prompt": "w " * 30, "max_tokens": 30, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            next(lines)  # a step later: the loop has counted the batch
            assert (m("milo:held_blocks"), m("milo:placed_blocks"), m("milo:kv_cache_bytes_held")) == (2, 2, 200)
            list(lines)
        deadline = time.monotonic() + 5
        while m("milo:placed_blocks") != 0:
            assert time.monotonic() < deadline, "the gauges did not fall once the row left"
            time.sleep(0.02)


def test_factor_bytes_staged_add_up_and_a_batch_that_holds_no_kv_leaves_the_gauges():
    metrics = ServerMetrics(["demo"])
    for staged in (300, 200):
        metrics.admitted([], {"blocks": 2, "unique_blocks": 2, "staged_bytes": staged}, [])
    metrics.held({"kv_bytes_held": 4096, "kv_bytes_kept": 1024, "held_blocks": 3, "placed_blocks": 12})
    metrics.held({})  # milo serve --vllm: vLLM's server holds the K/V
    value = metrics.registry.get_sample_value
    assert value("milo:factor_bytes_staged_total") == 500
    assert [value(f"milo:{name}") for name in ("kv_cache_bytes_held", "kv_cache_bytes_kept", "held_blocks",
                                               "placed_blocks")] == [4096, 1024, 3, 12]
