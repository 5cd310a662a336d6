"""Query-time recompute: each retrieved block's first n tokens computed again in the assembled context.

Held to three references on random tiny Qwen2 and Llama models (fp32, 1e-4): recomputing every token
is the `prefill` baseline; recomputing none is the plain store path; anything between is a
token-at-a-time forward over a transformers DynamicCache holding the rebuilt K/V of the tokens not
recomputed. Batched rows of different n must be the rows alone.
"""
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from milo_infer.bench import synthetic_model
from milo_infer.tasks.corpus import Demonstration, TaskSpec
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.errors import RequestError
from milo_infer.runtime.planning import EngineSettings, Request
from milo_infer.evaluation.evaluate import evaluate
from milo_store import MiloStore

from tests.infer.runtime.test_engine import ATOL, random_qwen2
from tests.infer.runtime.test_prefill import QUERIES, setup  # noqa: F401  (the fixture: an fp32 identity store, one context block)

STORED = [Request(r.text, k=r.k) for r in QUERIES]


def longest_block(store) -> int:
    return int(store.block_tokens.max())


def test_recomputing_every_token_reproduces_prefill(setup):
    loaded, store = setup
    engine = Engine(loaded, {"s": store})
    every = longest_block(store)
    plans = [engine.plan("s", Request(r.text, k=r.k, recompute=every)) for r in STORED]
    prefilled = engine.logits([engine.plan("s", r) for r in QUERIES])
    rebuilt = engine.logits([engine.plan("s", r) for r in STORED])
    for p, got, want, stale in zip(plans, engine.logits(plans), prefilled, rebuilt):
        q = len(engine.stores["s"].queries.query_ids(p.request))
        assert len(p.recompute) == p.prefix_tokens - engine.stores["s"].prefix.anchor_len
        assert (stale - want[-q:]).abs().max() > 10 * ATOL  # the context blocks do make a difference
        assert (got[-q:] - want[-q:]).abs().max() <= ATOL


def test_recomputing_no_token_is_the_plain_store_path(setup):
    loaded, store = setup
    engine = Engine(loaded, {"s": store}, settings=EngineSettings(recompute=4))
    plain = [engine.plan("s", Request(r.text, k=r.k, recompute=0)) for r in STORED]
    assert all(len(p.recompute) == 0 and p.query_ids == engine.stores["s"].queries.query_ids(p.request) for p in plain)
    default = Engine(loaded, {"s": store})
    for got, want in zip(engine.logits(plain), default.logits([default.plan("s", r) for r in STORED])):
        assert torch.equal(got, want)


def token_by_token(engine: Engine, request: Request, n: int) -> torch.Tensor:
    """The query's logits when the prefix's rebuilt K/V go into a DynamicCache position by position and each
    block's first n tokens are instead fed to the model one at a time (each attending to all before it)."""
    plain = engine.plan("s", Request(request.text, k=request.k, recompute=0))
    batch = engine.batch()
    batch.admit([plain])
    batch.step()  # rebuilds the prefix into the row's pages, columns [0, P)
    pages = batch.rows[0].pages
    rebuilt = [tuple(x[None] for x in batch.cache.row_kv(l, pages, plain.prefix_tokens))
               for l in range(len(batch.cache.layers))]
    recomputed = engine.plan("s", Request(request.text, k=request.k, recompute=n))
    again = dict(zip(recomputed.recompute.tolist(), recomputed.query_ids))
    reference = DynamicCache(config=engine.model.config)
    model = engine.model
    with torch.inference_mode():
        for position in range(plain.prefix_tokens):
            if position in again:
                model(input_ids=torch.tensor([[again[position]]]), position_ids=torch.tensor([[position]]),
                      use_cache=True, **{engine.cache_kwarg: reference})
            else:
                for l, (k, v) in enumerate(rebuilt):
                    reference.update(k[:, :, position:position + 1], v[:, :, position:position + 1], l)
        assert reference.get_seq_length() == plain.prefix_tokens
        q = plain.query_ids
        return model(input_ids=torch.tensor([q]), position_ids=plain.prefix_tokens + torch.arange(len(q))[None],
                     use_cache=True, **{engine.cache_kwarg: reference}).logits[0].float()


@pytest.mark.parametrize("n", [0, 1, 5])
def test_recomputing_the_first_tokens_equals_feeding_them_one_at_a_time(setup, n):
    loaded, store = setup
    engine = Engine(loaded, {"s": store})
    for request in STORED:
        plan = engine.plan("s", Request(request.text, k=request.k, recompute=n))
        got = engine.logits([plan])[0][len(plan.recompute):]
        want = token_by_token(Engine(loaded, {"s": store}, shared_blocks=False), request, n)  # its own pages
        assert (got - want).abs().max() <= ATOL


@pytest.mark.parametrize("chunk", [512, 4])
def test_rows_recomputing_different_numbers_of_tokens_batch_as_alone(setup, chunk):
    """Also fed 4 tokens a step: a recomputed token's fresh K/V are in its column before any later chunk reads it."""
    loaded, store = setup
    engine, whole = Engine(loaded, {"s": store}, settings=EngineSettings(prefill_chunk=chunk)), Engine(loaded, {"s": store})
    requests = [Request(r.text, k=r.k, recompute=n) for r, n in zip(STORED, (3, 0, 17))] + [QUERIES[0]]
    plans = [engine.plan("s", r) for r in requests]
    for p, got in zip(plans, engine.logits(plans)):
        alone = whole.logits([whole.plan("s", p.request)])[0]
        assert got.shape == alone.shape and (got - alone).abs().max() <= ATOL
    together = engine.answer(plans)
    assert [a.text for a in together] == [whole.answer([whole.plan("s", r)])[0].text for r in requests]


def test_a_recompute_plan_feeds_each_blocks_first_tokens_at_their_positions(setup):
    loaded, store = setup
    engine = Engine(loaded, {"s": store}, settings=EngineSettings(recompute=3))
    for request in STORED:
        plain = engine.plan("s", Request(request.text, k=request.k, recompute=0))
        plan = engine.plan("s", request)
        heads = [store.token_ids(b)[:3].tolist() for b in plan.blocks]
        assert plan.query_ids == [t for h in heads for t in h] + plain.query_ids
        assert plan.recompute.tolist() == [int(d) + j for d in plan.placement.dst_rows for j in range(3)]
        assert plan.prompt_tokens == plain.prompt_tokens and plan.prefix_tokens == plain.prefix_tokens
        assert plan.positions.tolist() == plan.recompute.tolist() + list(range(plain.prefix_tokens,
                                                                               plain.prompt_tokens))
        answer = engine.answer([plan])[0]
        assert answer.prefill_tokens == 3 * len(plan.blocks) + len(plain.query_ids)


def test_a_negative_recompute_or_a_store_without_token_ids_is_a_request_error(setup, tmp_path):
    loaded, store = setup
    with pytest.raises(RequestError, match="recompute must be 0 or more"):
        Engine(loaded, {"s": store}).plan("s", Request("refund", k=1, recompute=-1))
    qwen = random_qwen2()
    paths = synthetic_model.synthetic_stores(tmp_path, qwen, demos=16, block_size=8, demo_tokens=5, ratios=(0.5,),
                                             token_ids=False)
    with MiloStore.open(paths["full"]) as bare:
        engine = Engine(qwen, {"s": bare})
        assert len(engine.plan("s", Request("topic1", k=1)).recompute) == 0  # nothing asked, nothing needed
        with pytest.raises(RequestError, match="keeps no token ids.*recompute needs"):
            engine.plan("s", Request("topic1", k=1, recompute=2))


def test_milo_eval_recomputing_every_token_answers_as_prefill_and_logs_apart(setup, tmp_path):
    loaded, store = setup
    task = engine_task(store)
    items = [Demonstration(input=r.text, output=task.labels[i % len(task.labels)], id=str(i))
             for i, r in enumerate(QUERIES)]
    prefilled = evaluate(loaded, store.path, items, task, k=2, prefill=True)
    log = tmp_path / "p.jsonl"
    recomputed = evaluate(loaded, store.path, items, task, k=2, recompute=longest_block(store), predictions=log)
    assert recomputed["answers"] == prefilled["answers"]
    assert recomputed["prefill_tokens"] > evaluate(loaded, store.path, items, task, k=2)["prefill_tokens"]
    with pytest.raises(ValueError, match="another store, k"):  # a log of one n is not another's
        evaluate(loaded, store.path, items, task, k=2, recompute=3, predictions=log)


def engine_task(store) -> TaskSpec:
    return TaskSpec(**{**store.meta["task"], "labels": tuple(store.meta["task"]["labels"])})


def test_the_cost_tool_answers_every_query_at_every_setting(setup):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
    from recompute_cost import PREFILL, measure

    loaded, store = setup
    engine = Engine(loaded, {"store": store}, settings=EngineSettings(k=2))
    texts = [r.text for r in QUERIES]
    every = longest_block(store)
    result = measure(engine, texts, [0, 3, every, PREFILL])
    assert list(result) == ["0", "3", str(every), "prefill"]
    assert all(r["first_token_seconds"] > 0 for r in result.values())
    assert result[str(every)]["answers"] == result["prefill"]["answers"] and result[str(every)]["agreement_prefill"] == 1
    queries = [len(engine.plan("store", Request(t)).query_ids) for t in texts]
    recomputed = [len(engine.plan("store", Request(t, recompute=3)).recompute) for t in texts]
    assert result["0"]["prefill_tokens"] == sum(queries) / len(texts)
    assert result["3"]["prefill_tokens"] == (sum(queries) + sum(recomputed)) / len(texts)
    assert result["prefill"]["prefill_tokens"] > result["3"]["prefill_tokens"]


def test_recompute_on_a_hybrid_is_refused_by_the_engine_the_api_and_milo_query(tmp_path, capsys):
    """A hybrid's blocks carry its linear layers' state by pairs over all of their tokens: recomputing a block's first
    tokens would feed them to the recurrence twice, so recompute > 0 is refused naming why: a `RequestError` from the
    plan and from the engine's settings, a 400 in the API's error shape from `milo serve`'s app, one line from
    `milo query` (recompute 0 is answered)."""
    import httpx

    from milo_infer.building.builder import BuildConfig, build_store
    from milo_infer.cli.main import main as milo
    from milo_infer.models import load_model
    from milo_store import CompressionConfig
    from tests.infer import families
    from tests.infer.server.serving import serving
    from tests.infer.server.test_failures import error_of
    from tests.infer.test_check_model import saved

    model_dir = saved("qwen3_5_text", tmp_path / "model")
    loaded = load_model(model_dir)
    config = BuildConfig(block_size=2, context_blocks=0, order="corpus",
                         compression=CompressionConfig(ratio=1.0, codec="identity", dtype="float32"))
    build_store(tmp_path / "s", loaded, families.demonstrations(8), families.TASK, config, progress=False)
    with MiloStore.open(tmp_path / "s") as store:
        engine = Engine(loaded, {"s": store})
        assert engine.plan("s", Request("refund", k=1, recompute=0)).blocks
        with pytest.raises(RequestError, match="refused on a hybrid model.*recurrence twice"):
            engine.plan("s", Request("refund", k=1, recompute=2))
        with pytest.raises(RequestError, match="refused on a hybrid model"):
            Engine(loaded, {"s": store}, EngineSettings(recompute=2))
        with serving(engine, batch_wait_ms=1) as served:
            body = {"model": "s", "prompt": "refund", "max_tokens": 2}
            assert httpx.post(served.base + "/v1/completions", json=body, timeout=60).status_code == 200
            refused = httpx.post(served.base + "/v1/completions", json={**body, "recompute": 2}, timeout=60)
            assert "refused on a hybrid model" in error_of(refused, 400)["message"]
    capsys.readouterr()
    assert milo(["query", str(tmp_path / "s"), "refund", "--model", model_dir, "--recompute", "2"]) == 2
    err = capsys.readouterr().err  # after the weights' loading bar
    assert "refused on a hybrid model" in err.strip().splitlines()[-1] and "Traceback" not in err
