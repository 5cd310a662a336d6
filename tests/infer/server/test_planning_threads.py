"""Planning from many threads at once with the default model's one fast tokenizer, as a busy server does
(`plan_query` runs on the request handlers' worker threads while the engine loop decodes)."""
import threading
import time

import numpy as np
import pytest

from milo_infer.runtime.engine import Engine
from milo_infer.server.app import create_app, plan_query
from milo_infer.server.protocol import parse_request
from milo_infer.tasks.corpus import load_corpus
from milo_store import CompressionConfig
from tests.infer.demo_stores import DEMO, encoded_demo_stores

pytestmark = pytest.mark.slow
THREADS = 32


class OneEncoderAtATime:
    """The tokenizer as it behaves with a tokenizers release before 0.23.1 (transformers 5 allows them):
    the Rust tokenizer refuses ('Already borrowed') to be reconfigured while another thread encodes, and
    transformers reconfigures it on a call that asks for other settings, so two encodes at once can fail.
    The installed release locks inside, so this double makes that race certain instead of rare."""

    def __init__(self, tokenizer):
        self.tokenizer, self.busy = tokenizer, threading.Lock()

    def __call__(self, *args, **kwargs):
        if not self.busy.acquire(blocking=False):
            raise RuntimeError("Already borrowed")
        try:
            time.sleep(0.001)  # an encode with the GIL released: another thread runs meanwhile
            return self.tokenizer(*args, **kwargs)
        finally:
            self.busy.release()

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, default_model):
    stores = encoded_demo_stores(tmp_path_factory, default_model, {"demo": CompressionConfig(ratio=0.5)})
    opened, _ = next(stores)
    yield Engine(default_model, opened)
    next(stores, None)


@pytest.mark.parametrize("tokenizer", ["as installed", "before tokenizers 0.23.1"])
def test_planning_from_32_threads_at_once_never_raises(engine, tokenizer, monkeypatch):
    store = engine.stores["demo"].queries  # the tokenizer a plan encodes with
    if tokenizer != "as installed":
        monkeypatch.setattr(store, "tokenizer", OneEncoderAtATime(store.tokenizer))
    state = create_app(engine).state
    queries = [d.input for d in load_corpus(DEMO)[8:8 + THREADS]]
    parsed = [parse_request({"model": "demo", "prompt": q}, chat=False, models=engine.stores,
                            max_positions=engine.max_positions) for q in queries]
    alone = [plan_query(state, p) for p in parsed]
    start, plans, errors = threading.Barrier(THREADS + 1), [None] * THREADS, []

    def plan(i):
        start.wait()
        try:
            plans[i] = plan_query(state, parsed[i])
        except Exception as e:
            errors.append(e)

    def decode():  # the engine loop's part meanwhile
        start.wait()
        for _ in range(200):
            engine.tokenizer.decode(alone[0].query_ids, skip_special_tokens=True)

    threads = [threading.Thread(target=plan, args=(i,)) for i in range(THREADS)] + [threading.Thread(target=decode)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert [p.query_ids for p in plans] == [p.query_ids for p in alone]
    assert all(np.array_equal(p.placement.dst_rows, q.placement.dst_rows) and p.blocks == q.blocks
               for p, q in zip(plans, alone))
