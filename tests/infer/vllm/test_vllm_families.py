"""The connector over every distinct attention path vLLM's CPU build serves: one real vLLM per family.

Each family's tiny random model (`tests/infer/families.py`, in a shape vLLM's CPU attention takes: head_dim 64,
or gemma's 256) is saved as a Hugging Face directory with the byte-level tokenizer, and an identity store
(raw fp32 units) is built from it by `milo build`'s code. Two checks per family, the Llama path's
(`test_vllm_parallel.py`) and more: blocks 0..w in store order (each encoded after exactly the blocks
before it, so block-wise encoding is prefill) must give vLLM's own first-token logprobs; retrieved blocks
in retrieval order (at other positions than they were encoded at) must give the log-softmax of milo's
engine's logits as vLLM's first-token logprobs, and milo's greedy answers, on 20 queries. Where the head
split meets a family's own path (a fused projection, a norm across heads) it also runs at
``--tensor-parallel-size 2``. Which families vLLM's CPU build serves and which not, and why, is in
docs/design.md ("Model families").
"""
import concurrent.futures
import math
import string

import httpx
import pytest
import torch

from milo_infer.building.config import BuildConfig, default_compression
from milo_infer.building.shared_staging import encode_once
from milo_infer.models.families import attention_of, layer_specs
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.planning import STOP_STRINGS, EngineSettings, Request
from milo_infer.tasks.corpus import Demonstration, TaskSpec
from milo_infer.vllm.transfer import VllmPrompts
from milo_store import MiloStore
from tests.infer import families
from tests.infer.vllm.test_vllm_parallel import eventually, metric
from tests.infer.vllm.vllm_server import vllm_python, vllm_server

VLLM_SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                  max_position_embeddings=2048)  # head_dim 64: vLLM's CPU attention takes 32 and up
# family -> what it proves through vLLM; the tensor-parallel sizes it runs at (2: its 2 KV heads split over two
# workers, where the head split meets the family's own path: a fused projection, a norm across heads)
SERVED = {
    "qwen3_moe": ("k_norm per head, and MoE experts", (1,)),
    "olmo2": ("k_norm over the whole projection (vLLM's Transformers backend)", (1, 2)),
    "phi3": ("a fused qkv_proj", (1, 2)),
    "smollm3": ("NoPE layers (vLLM's Transformers backend)", (1,)),
    "gemma": ("head_dim 256", (1,)),
    "granite": ("attention, embedding, residual and logits multipliers", (1,)),
    "cohere": ("interleaved RoPE pairs, LayerNorm per head", (1,)),
    "ernie4_5": ("interleaved pairs on re-laid rotate-half tables", (1,)),
    "seed_oss": ("q/k/v biases and an o_proj bias", (1,)),
    "dots1": ("k_norm per head, shared and routed experts, a window of 8 on layer 1", (1,)),
    "starcoder2": ("q/k/v/o biases and LayerNorm, a window of 8 on every layer (one KV cache group, all sliding)",
                   (1,)),
    "gemma3_text": ("a window of 8 on alternate layers (vLLM's hybrid KV cache manager: the window layers' own KV "
                    "cache group, pages only for the blocks the window reaches), RoPE per layer type", (1,)),
    "gpt_oss": ("a window of 8 on alternate layers, a sink per head, experts", (1,)),
    "glm4_moe": ("rotate-half over half the head (GLM-4.5), k_norm per head, shared and routed experts", (1,)),
    "phi": ("rotate-half over half the head, biases, an output projection named dense", (1,)),
    "stablelm": ("rotate-half over a quarter of the head, q/k/v biases", (1,)),
    "nemotron": ("rotate-half over half the head, LayerNorm1P", (1,)),
    "gemma4_text": ("per-layer shapes (sliding layers' heads of 64 beside full layers' one of 128), K = V on the full "
                    "layers, proportional RoPE, two layers attending earlier layers' K/V (none written for them)",
                    (1,)),
}
VLLM_OVERRIDES = {"gemma": dict(head_dim=256), "gemma3_text": dict(head_dim=64), "gpt_oss": dict(head_dim=64),
                  "ernie4_5": dict(head_dim=64, use_bias=False),  # vLLM's Ernie (a Llama) drops use_bias's biases
                  "cohere": dict(tie_word_embeddings=True),  # vLLM's Cohere always reads logits off the embeddings
                  "seed_oss": dict(head_dim=64),
                  "glm4_moe": dict(head_dim=64),  # vLLM's GLM-4.5 reads head_dim, which GLM-4.5's config.json has
                  "stablelm": dict(qk_layernorm=False),  # vLLM 0.32's StableLM has no per-head LayerNorm (2 12B's)
                  "gemma4_text": dict(head_dim=64, global_head_dim=128)}
RUNS = [(family, tp) for family, (_, sizes) in SERVED.items() for tp in sizes]
TASK = TaskSpec(name="numbers", template="Message: {input}\nNumber: {output}\n", anchor="Number each message.",
                answer_kind="number")
SHOTS, BLOCK, CONTEXT, K = 32, 4, 2, 3  # 8 blocks of 4 demonstrations; 3 retrieved
N_QUERIES, ANSWER_TOKENS = 20, 6
LOGPROB_TOL = 1e-3  # fp32 vLLM against fp32 raw K/V


def demonstrations(n: int = SHOTS, offset: int = 0) -> list[Demonstration]:
    words = ("card", "cash", "pin", "fee", "refund", "limit", "account", "transfer")
    return [Demonstration(input=f"{words[i % 8]} {words[(i * 3) % 8]} {i}", output=str((i * 5) % 8), id=str(i))
            for i in range(offset, offset + n)]


def requests() -> list[Request]:
    return [Request(text=d.input, max_new_tokens=ANSWER_TOKENS) for d in demonstrations(N_QUERIES, offset=SHOTS)]


def letters_only(loaded) -> None:
    """Every logit but the ASCII letters' is 0 and theirs random, so greedy answers are letters, one byte a token:
    equal texts are equal token ids (a random model's bytes are mostly not UTF-8, which each engine's
    detokenizer renders in its own way). A tied model's other input embeddings are 0 too: a random model still."""
    letters = loaded.tokenizer.convert_tokens_to_ids(list(string.ascii_letters))
    head = loaded.model.get_output_embeddings().weight
    with torch.no_grad():
        kept = head[letters].clone()
        head.zero_()
        head[letters] = kept


def complete(url, body) -> dict:
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each family's model directory, milo's model and its identity store, made once for all its runs."""
    vllm_python()  # skip before anything is built where vLLM is not installed
    made = {}

    def build(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            shape = {**VLLM_SHAPE, **VLLM_OVERRIDES.get(name, {})}
            loaded = families.tiny_model(name, **shape)
            letters_only(loaded)
            loaded.model.save_pretrained(root / "model")
            loaded.tokenizer.save_pretrained(root / "model")
            configs = {"raw": default_compression(1.0, codec="raw", dtype="float32")}
            encode_once(loaded, demonstrations(), TASK, BuildConfig(block_size=BLOCK, context_blocks=CONTEXT), configs,
                        root, progress=False)
            made[name] = (root, loaded, MiloStore.open(root / "raw"))
        return made[name]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared machine: vLLM's workers need the cores
    yield build
    for _, _, store in made.values():
        store.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=RUNS, ids=[f"{family}-tp{tp}" for family, tp in RUNS])
def family(request, built):
    """(family, model directory, milo's model, its identity store, vLLM's URL) for one vLLM server."""
    name, tp = request.param
    root, loaded, store = built(name)
    with vllm_server([root / "raw"], root / f"vllm-tp{tp}.log", model=str(root / "model"), tier="disk",
                     max_model_len=2048, vllm_args=("--tensor-parallel-size", str(tp))) as url:
        yield name, str(root / "model"), loaded, store, url


def test_an_identity_store_reproduces_vllms_own_prefill(family):
    name, model_dir, loaded, store, url = family
    prompts = VllmPrompts("raw", store, loaded.tokenizer, settings=EngineSettings(k=K))
    for request in requests()[:3]:
        prompt = prompts.prompt(request, blocks=list(range(CONTEXT + 1)))
        ours, plain = (complete(url, {**prompt.body(model_dir, max_tokens=1, logprobs=5, use_store=use),
                                      "return_tokens_as_token_ids": True}) for use in (True, False))
        assert ours["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt.prefix_tokens
        got, want = (r["choices"][0]["logprobs"]["top_logprobs"][0] for r in (ours, plain))
        shared = got.keys() & want.keys()
        assert len(shared) >= 4 and all(math.isclose(got[t], want[t], abs_tol=LOGPROB_TOL) for t in shared), \
            (name, got, want)


def test_greedy_answers_equal_milos_engine(family):
    """Retrieved blocks in retrieval order, each at other positions than it was encoded at: vLLM's first-token
    logprobs are the log-softmax of milo's engine's logits, and its greedy answers milo's."""
    name, model_dir, loaded, store, url = family
    engine = Engine(loaded, {"raw": store}, settings=EngineSettings(k=K))
    plans = [engine.plan("raw", r) for r in requests()]
    assert any(list(p.blocks) != sorted(p.blocks) for p in plans)  # blocks moved, not only store order
    milo = [a.text.strip() for a in engine.answer(plans)]
    first = [torch.log_softmax(logits[-1], dim=-1) for logits in engine.logits(plans)]
    prompts = VllmPrompts("raw", store, loaded.tokenizer, settings=EngineSettings(k=K))
    bodies = [{**prompts.prompt(r).body(model_dir, max_tokens=ANSWER_TOKENS, logprobs=5), "stop": list(STOP_STRINGS),
               "return_tokens_as_token_ids": True} for r in requests()]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda body: complete(url, body), bodies))
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in results)
    for result, ours in zip(results, first):
        for token, logprob in result["choices"][0]["logprobs"]["top_logprobs"][0].items():
            assert math.isclose(logprob, float(ours[int(token.removeprefix("token_id:"))]), abs_tol=LOGPROB_TOL), \
                (name, token, logprob)
    theirs = [r["choices"][0]["text"].strip() for r in results]
    assert theirs == milo, (name, [(a, b) for a, b in zip(theirs, milo) if a != b])


def test_a_window_layer_is_written_only_where_its_kv_cache_group_holds_pages(family):
    """Every layer's K/V of every loaded token is written, but a window layer's only for the tokens vLLM's hybrid
    KV cache manager keeps pages for in its group: at least the last W - 1 (what the query's window reaches), fewer
    than all of them once the prefix passes a vLLM block beyond the window. Counted on tensor-parallel rank 0: each
    rank loads and writes every token of every layer for its own heads, and counts them."""
    name, model_dir, loaded, store, url = family
    held = [spec.holds_cache for spec in layer_specs(loaded.model.config)]  # a shared layer's K/V are its source's
    windows = [w for w, h in zip(attention_of(loaded.model.config).windows(loaded.model.config), held) if h]
    prompt = VllmPrompts("raw", store, loaded.tokenizer, settings=EngineSettings(k=K)).prompt(requests()[0])

    def count(key):
        return metric(url, f"vllm:milo_{key}_total", tp_rank=0)

    before = [count(key) for key in ("tokens_loaded", "layer_tokens_written")]
    complete(url, prompt.body(model_dir, max_tokens=1))
    assert eventually(lambda: count("tokens_loaded") == before[0] + prompt.prefix_tokens)
    assert eventually(lambda: count("layer_tokens_written") > before[1])
    written, tokens = count("layer_tokens_written") - before[1], prompt.prefix_tokens
    if all(w is None for w in windows):
        assert written == len(windows) * tokens
    else:
        least = sum(tokens if w is None else w - 1 for w in windows)
        assert least <= written < len(windows) * tokens, (name, written, least, tokens)
