"""`milo_infer.runtime.sampling.choose`: greedy as before, each row sampled with its own settings and seed, the
model's own log probabilities; and a JSON schema's decoder (`milo_infer.runtime.grammar`) over the real tokenizer."""
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from milo_infer.runtime.errors import RequestError
from milo_infer.runtime.sampling import NUCLEUS_START, RowSampler, SamplingParams, choose
from tests.infer.runtime.test_decoding import tok  # noqa: F401 (a fixture)

V = 50


def logits_rows(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, vocab)).astype(np.float32) * 2)


def draw(logits: torch.Tensor, params: SamplingParams, steps: int, allowed=None) -> list[int]:
    """``steps`` tokens of one row from the same logits (its generator moves on each step)."""
    sampler = RowSampler(params)
    return [choose(logits[None], [sampler], [allowed], [[]])[0][0] for _ in range(steps)]


def test_greedy_is_the_largest_logit_lowest_id_on_ties_nan_lowest_and_within_what_is_allowed():
    logits = torch.tensor([[1.0, 3.0, 3.0, float("nan"), 0.0], [float("nan")] * 5])
    tokens, entries = choose(logits, [RowSampler(), RowSampler()], [None, [2, 4]], [[], []])
    assert tokens == [1, 2] and entries == [None, None]
    assert choose(logits[:1], [RowSampler()], [[0, 4]], [[]])[0] == [0]


def test_a_seeded_row_draws_the_same_tokens_alone_and_in_a_batch_of_16_with_other_settings():
    logits = logits_rows(16, seed=1)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    alone = [draw(logits[r], params, 20) for r in range(3)]
    others = [SamplingParams(temperature=t, top_k=k, min_p=m, seed=s) for t, k, m, s in
              zip(np.linspace(0.2, 1.5, 13), range(1, 14), np.linspace(0, 0.2, 13), range(100, 113))]
    samplers = [RowSampler(params) for _ in range(3)] + [RowSampler(p) for p in others]
    batched = [[] for _ in range(3)]
    for _ in range(20):
        tokens, _ = choose(logits, samplers, [None] * 16, [[]] * 16)
        for r in range(3):
            batched[r].append(tokens[r])
    assert batched == alone
    assert draw(logits[0], SamplingParams(temperature=0.8, top_p=0.9, seed=8), 20) != alone[0]


def test_draws_follow_the_softmax_over_the_temperature():
    logits = logits_rows(1, seed=2, vocab=6)[0]
    counts = np.bincount(draw(logits, SamplingParams(temperature=0.7, seed=0), 20000), minlength=6) / 20000
    assert np.abs(counts - torch.softmax(logits / 0.7, 0).numpy()).max() < 0.015


def test_top_k_top_p_and_min_p_keep_exactly_their_tokens():
    logits = logits_rows(1, seed=3)[0]
    order = logits.argsort(descending=True).tolist()
    assert set(draw(logits, SamplingParams(temperature=1, top_k=3, seed=0), 400)) == set(order[:3])
    probs = torch.softmax(logits, 0)
    mass = probs[order].cumsum(0)
    nucleus = order[:int((mass < 0.6).sum()) + 1]
    assert set(draw(logits, SamplingParams(temperature=1, top_p=0.6, seed=0), 600)) == set(nucleus)
    kept = {t for t in range(V) if probs[t] >= 0.3 * probs.max()}
    assert set(draw(logits, SamplingParams(temperature=1, min_p=0.3, seed=0), 600)) == kept


def test_a_nucleus_wider_than_the_first_candidates_is_found_whole():
    vocab = NUCLEUS_START * 8
    flat = torch.zeros(vocab)  # every token equally likely: the nucleus of 0.9 is 90% of the vocabulary
    seen = set(draw(flat, SamplingParams(temperature=1, top_p=0.9, seed=0), 5000))
    assert len(seen) > NUCLEUS_START * 4 and max(seen) >= vocab // 2


def test_penalties_lower_the_tokens_the_answer_holds():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    greedy_penalised = RowSampler(SamplingParams(presence_penalty=0.5))
    assert choose(logits, [greedy_penalised], [None], [[0]])[0] == [1]
    frequency = RowSampler(SamplingParams(frequency_penalty=0.06))
    assert choose(logits, [frequency], [None], [[0]])[0] == [0] and choose(logits, [frequency], [None], [[0, 0]])[0] == [1]


def test_log_probabilities_are_the_models_softmax_of_the_raw_logits():
    logits = logits_rows(4, seed=4)
    samplers = [RowSampler(SamplingParams(logprobs=5)), RowSampler(SamplingParams(temperature=2, logprobs=0, seed=1,
                                                                                  presence_penalty=1)),
                RowSampler(), RowSampler(SamplingParams(logprobs=20))]
    tokens, entries = choose(logits, samplers, [None, None, [3], [7, 9]], [[], [1], [], []])
    reference = torch.log_softmax(logits.double(), 1)
    assert entries[2] is None
    for r in (0, 1, 3):
        assert entries[r].token == tokens[r]
        assert abs(entries[r].logprob - reference[r, tokens[r]]) < 1e-5
        top = reference[r].topk(samplers[r].params.logprobs)
        assert [t for t, _ in entries[r].top] == top.indices.tolist()
        assert np.allclose([lp for _, lp in entries[r].top], top.values.numpy(), atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 31), temperature=st.floats(0.05, 3), top_p=st.floats(0.01, 1), top_k=st.integers(0, V),
       min_p=st.floats(0, 1), allowed=st.lists(st.integers(0, V - 1), min_size=1, unique=True))
def test_a_drawn_token_is_allowed_and_never_one_the_filters_removed(seed, temperature, top_p, top_k, min_p, allowed):
    logits = logits_rows(1, seed=seed % 1000)[0]
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    for token in draw(logits, params, 5, sorted(allowed)):
        assert token in allowed
        masked = torch.full((V,), float("-inf"))
        masked[sorted(allowed)] = logits[sorted(allowed)] / temperature
        probs = torch.softmax(masked, 0)
        assert probs[token] >= min_p * probs.max() - 1e-6
        if top_k:
            assert int((masked > masked[token]).sum()) < top_k


def test_bad_settings_are_refused_naming_them():
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="logprobs must be between 0 and 20"):
        SamplingParams(logprobs=21)


LABELS = ["card_arrival", "card_linking", "exchange_rate", "Refund_not_showing_up"]
SCHEMAS = {"enum": {"enum": LABELS},
           "object": {"type": "object", "properties": {"label": {"enum": LABELS}, "sure": {"type": "boolean"}},
                      "required": ["label", "sure"], "additionalProperties": False}}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_schemas_decoder_answers_json_of_the_schema_whatever_the_logits(tok, name):  # noqa: F811
    from milo_infer.runtime.grammar import compile_grammar

    grammar = compile_grammar(tok, "json", json.dumps(SCHEMAS[name]))
    rng = np.random.default_rng(0)
    for seed in range(8):
        decoder = grammar.decoder(tok, 64)
        sampler = RowSampler(SamplingParams(temperature=1.5, seed=seed))
        while not decoder.done:
            logits = torch.from_numpy(rng.standard_normal((1, len(tok) + 7)).astype(np.float32))
            (token,), _ = choose(logits, [sampler], [decoder.allowed()], [decoder.ids])
            decoder.accept(token)
        answer = json.loads(decoder.result().text)
        assert decoder.stop == "eos" and decoder.ids[-1] == tok.eos_token_id
        assert (answer if name == "enum" else answer["label"]) in LABELS


def test_a_schema_that_cannot_be_compiled_is_a_request_error(tok):  # noqa: F811
    from milo_infer.runtime.grammar import compile_grammar

    with pytest.raises(RequestError, match="JSON schema"):
        compile_grammar(tok, "json", '{"type": "no such type"}')


def test_the_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_answer_tokens():
    logits = torch.tensor([[4.0, 3.5, -1.0, -1.2, 0.5]])
    sampler = RowSampler(SamplingParams(repetition_penalty=2.0), prompt=[0])
    # token 0 (in the prompt) falls to 2.0 under token 1's 3.5; token 2 (answered) to -2.0 under token 3's -1.2
    assert choose(logits, [sampler], [None], [[]])[0] == [1]
    assert choose(logits, [sampler], [[2, 3]], [[2]])[0] == [3]
    assert choose(logits, [RowSampler(SamplingParams())], [[2, 3]], [[2]])[0] == [2]
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0)
