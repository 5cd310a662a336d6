"""`milo serve` under a KV budget too small for its 16 long rows (issue 40): every request is answered, as alone,
the rows waiting for pages rather than failing; a request that can never fit is a 400 naming the sizes; the
server's pools never exceed the budget. The real engine over a 131,072-position tiny model, in process."""
import concurrent.futures

import httpx

from milo_infer.runtime.engine import Engine
from milo_infer.runtime.planning import EngineSettings, Request

from tests.infer.runtime.test_kv_memory import K, ROWS, long_context, long_queries, rows_need  # noqa: F401 (fixture)
from tests.infer.server.serving import serving

REQUEST_TIMEOUT_S = 120


def test_a_budget_too_small_for_16_long_rows_answers_every_request_waiting_for_pages(long_context):  # noqa: F811
    loaded, store = long_context
    reference = Engine(loaded, {"s": store}, EngineSettings(k=K))
    queries = long_queries()
    plans = [reference.plan("s", Request(q)) for q in queries]
    alone = {q: reference.answer([p])[0].text for q, p in zip(queries, plans)}
    need, rounded = rows_need(reference, plans)
    budget = rounded // 4  # about four of the sixteen rows at once
    engine = Engine(loaded, {"s": store}, EngineSettings(k=K), kv_cache_memory=budget)
    batches = []
    made = engine.batch
    engine.batch = lambda: batches.append(made()) or batches[-1]
    with serving(engine, max_batch=ROWS) as served:
        def ask(text: str) -> httpx.Response:
            return httpx.post(f"{served.base}/v1/completions", json={"model": "s", "prompt": text},
                              timeout=REQUEST_TIMEOUT_S)
        with concurrent.futures.ThreadPoolExecutor(ROWS) as pool:
            replies = list(pool.map(ask, queries))
        too_long = httpx.post(f"{served.base}/v1/completions", timeout=REQUEST_TIMEOUT_S,
                              json={"model": "s", "prompt": "topic1 " + "x" * (budget // engine.page_bytes * 128)})
    assert [r.status_code for r in replies] == [200] * ROWS
    assert [r.json()["choices"][0]["text"] for r in replies] == [alone[q] for q in queries]
    assert too_long.status_code == 400 and too_long.headers["x-should-retry"] == "false"
    assert "more than the whole KV budget" in too_long.json()["error"]["message"]
    assert len(batches) == 1 and 0 < batches[0].kv_bytes_allocated <= budget < need
