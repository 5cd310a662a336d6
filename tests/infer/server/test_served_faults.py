"""Issue 31's served case: two stores mounted, one with a damaged block on the disk tier, 16 clients on both at
once. The healthy store answers as alone; the damaged one answers by computing the block (or, under
``on_load_error="fail"``, fails those requests with a 500 naming the block); /health stays 200; every request
ends within a bound. A random tiny Qwen2 over identity stores of the shipped demo corpus, in process."""
import concurrent.futures

import httpx
import pytest

from milo_infer.runtime.engine import Engine
from milo_infer.runtime.planning import EngineSettings, Request
from milo_store import MiloStore

from tests.infer.runtime.test_faults import stores  # noqa: F401  (the fixture: a clean and a damaged store)
from tests.infer.server.serving import metric, serving

QUERIES = ["my card is gone", "refund please", "where is my money", "I lost my card", "my payment was declined",
           "can I change my pin", "how long does a transfer take", "my card is not working"]
K = 6  # every group of the 24-demonstration store: every query needs the damaged block
REQUEST_TIMEOUT_S = 120


def ask(base: str, model: str, text: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": text},
                      timeout=REQUEST_TIMEOUT_S)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_damaged_block_stays_with_the_requests_that_need_it(stores, policy):  # noqa: F811
    loaded, clean, damaged, bad = stores
    reference = Engine(loaded, {"s": clean}, EngineSettings(k=K))
    alone = {t: reference.answer([reference.plan("s", Request(t))])[0].text for t in QUERIES}
    computed = {t: reference.answer([reference.stores["s"].without_blocks(reference.plan("s", Request(t)), {bad})])[0].text
                for t in QUERIES}
    engine = Engine(loaded, {"good": clean, "bad": damaged}, EngineSettings(k=K), on_load_error=policy)
    with serving(engine, max_batch=4) as served:
        jobs = [(model, text) for text in QUERIES for model in ("good", "bad")]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda job: ask(served.base, *job), jobs))
        health = httpx.get(f"{served.base}/health", timeout=10)
        per_bad_request = ('milo:recomputed_blocks_total{model_name="bad"}' if policy == "recompute" else
                           'milo:request_errors_total{code="block_unreadable"}')  # one damaged block in each
        counted = {name: metric(served.base, name) for name in (
            per_bad_request, 'milo:recomputed_blocks_total{model_name="good"}', "milo:unreadable_blocks_total",
            'milo:blocks_read_total{tier="disk"}', 'milo:blocks_read_total{tier="memory"}')}
    assert health.status_code == 200
    assert counted[per_bad_request] == len(QUERIES) and counted['milo:recomputed_blocks_total{model_name="good"}'] == 0
    if policy == "recompute":  # every admission holding a bad row found the damaged block unreadable
        assert counted["milo:unreadable_blocks_total"] >= 1
    assert counted['milo:blocks_read_total{tier="disk"}'] > 0 and counted['milo:blocks_read_total{tier="memory"}'] == 0
    for (model, text), reply in zip(jobs, replies):
        if model == "good":
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == alone[text]
        elif policy == "recompute":
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == computed[text]
        else:
            error = reply.json()["error"]
            assert reply.status_code == 500 and error["code"] == "block_unreadable"
            assert f"store 'bad': block {bad} cannot be read" in error["message"]
