"""Rows that sample, report log probabilities, answer n times or read a system prompt, in the batched engine
(random tiny models in fp32, as tests/infer/runtime/test_engine.py)."""
import pytest
import torch

from milo_infer.building.builder import build_store
from milo_infer.building.config import BuildConfig
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.planning import EngineSettings, Request, answers_of
from milo_infer.runtime.sampling import SamplingParams
from milo_infer.tasks.corpus import Demonstration, TaskSpec
from milo_store import CompressionConfig, MiloStore
from tests.infer.runtime.test_engine import free_form, setup  # noqa: F401 (a fixture)
from tests.infer.runtime.test_shared_blocks import hold_every_shared_block

SAMPLED = Request("topic1 topic2 q", k=2, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=11, logprobs=3))


def test_a_seeded_row_answers_the_same_alone_and_in_a_batch_of_16(setup):  # noqa: F811
    loaded, store = setup
    engine = free_form(Engine(loaded, {"s": store}, settings=EngineSettings(max_new_tokens=6)))
    alone = engine.answer([engine.plan("s", SAMPLED)])[0]
    others = [Request(f"topic{i % 5} other {i}", k=1 + i % 3,
                      sampling=SamplingParams(temperature=0.3 + i / 10, top_k=i, min_p=0.01 * i, seed=i))
              for i in range(15)]
    batched = engine.answer([engine.plan("s", r) for r in [*others[:7], SAMPLED, *others[7:]]])[7]
    assert [e.token for e in batched.logprobs] == [e.token for e in alone.logprobs] and batched.text == alone.text
    greedy = engine.answer([engine.plan("s", Request(SAMPLED.text, k=2))])[0]
    moved = engine.answer([engine.plan("s", Request(SAMPLED.text, k=2, sampling=SamplingParams(
        temperature=0.9, top_p=0.95, seed=12, logprobs=0)))])[0]
    assert {alone.text, greedy.text, moved.text} != {alone.text}  # the seed and the settings decide


def test_label_log_probabilities_are_the_models_softmax(setup):  # noqa: F811
    loaded, store = setup
    engine = Engine(loaded, {"s": store})
    plan = engine.plan("s", Request("topic3 which label", k=2, sampling=SamplingParams(logprobs=5)))
    first = engine.answer([plan])[0].logprobs[0]
    reference = torch.log_softmax(engine.logits([plan])[0][-1].double(), 0)
    assert abs(first.logprob - reference[first.token]) < 1e-5
    assert [t for t, _ in first.top] == reference.topk(5).indices.tolist()
    assert max(abs(lp - reference[t]) for t, lp in first.top) < 1e-5


def test_n_answers_of_one_plan_read_and_hold_its_blocks_once(setup, monkeypatch):  # noqa: F811
    hold_every_shared_block(monkeypatch)
    loaded, store = setup
    engine = free_form(Engine(loaded, {"s": store}, settings=EngineSettings(max_new_tokens=6)))
    plan = engine.plan("s", Request("topic0 topic4 n answers", k=3, sampling=SamplingParams(temperature=1.5, seed=3,
                                                                                            logprobs=0)))
    rows = answers_of(plan, 4)
    batch = engine.batch()
    done, events = {}, batch.admit(rows)
    assert batch.fetch_stats["unique_blocks"] == len(plan.blocks) and batch.fetch_stats["blocks"] == 4 * len(plan.blocks)
    assert batch.held_counts()["held_blocks"] == len(plan.blocks)
    while True:
        done.update({id(e.plan): e.answer for e in events if e.finished})
        if not len(batch):
            break
        events = batch.step()
    tokens = [[e.token for e in done[id(r)].logprobs] for r in rows]
    assert len({tuple(t) for t in tokens}) > 1  # each answer its own seed
    assert tokens[2] == [e.token for e in engine.answer([rows[2]])[0].logprobs]  # and reproducible alone


SYSTEM = "You are a careful labeller."


@pytest.fixture(scope="module")
def system_store(setup, tmp_path_factory):  # noqa: F811
    """An identity store of a system prompt and 4 blocks, each encoded after the anchor alone: a one-block context
    holds the K/V a prefill of the same prompt computes."""
    loaded, _ = setup
    task = TaskSpec("t", "Input: {input}\nLabel: {output}\n", "Label each input.", "label", ("yes", "no"),
                    system=SYSTEM)
    demos = [Demonstration(f"topic{i % 4} demonstration {i}", ("yes", "no")[i % 2], str(i)) for i in range(8)]
    out = tmp_path_factory.mktemp("system") / "s"
    build_store(out, loaded, demos, task, BuildConfig(block_size=2, context_blocks=0, order="corpus",
                compression=CompressionConfig(codec="identity", ratio=1.0, dtype="float32")), progress=False)
    with MiloStore.open(out) as store:
        yield loaded, store


def test_a_store_built_with_a_system_prompt_answers_as_a_prefill_of_the_same_prompt(system_store):
    loaded, store = system_store
    assert store.meta["task"]["system"] == SYSTEM
    assert store.meta["build"]["anchor_token_ids"] == loaded.tokenizer(f"{SYSTEM}\n\nLabel each input.").input_ids
    engine = Engine(loaded, {"s": store})
    stored, prefilled = (engine.plan("s", Request("topic2 demonstration", k=1, prefill=p)) for p in (False, True))
    assert stored.blocks and len(prefilled.query_ids) > len(stored.query_ids)
    assert (engine.logits([stored])[0][-1] - engine.logits([prefilled])[0][-1]).abs().max() < 1e-4
    other = engine.plan("s", Request("topic2 demonstration", k=1, system="Be brief."))
    assert other.query_ids[-len(stored.query_ids):] == stored.query_ids and len(other.query_ids) > len(stored.query_ids)
