"""Llama 4 (issue 60, item 4): exact within its first attention chunk, refused past it (`milo_infer.models.chunked`).

The conformance suite runs its tiny model (`families.TINY["llama4_text"]`: chunks of 512, floor_scale 512). Here:
why past the first chunk no stored block is what the model computes (measured on the model itself), that its
positions are capped so a build or query past them is refused, and that the query temperature milo turns off is the
model's below the cap, even where the engine packs rows past floor_scale in one forward.
"""
import json

import pytest
import torch
import transformers

from milo_infer.building.builder import build_store
from milo_infer.building.config import BuildConfig, BuildError
from milo_infer.evaluation.conformance import Deviation
from milo_infer.models import LoadedModel
from milo_infer.models.chunked import first_chunk_positions
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.errors import RequestError
from milo_infer.runtime.planning import EngineSettings, Request
from milo_infer.tasks.corpus import Demonstration
from tests.infer import families
from tests.infer.test_conformance import QUERY, identity_store


def llama4(**overrides):
    """A 4-layer tiny Llama 4 as transformers makes it (its temperature on): layer 1 NoPE, the others chunked."""
    config = families.config("llama4_text", num_hidden_layers=4, no_rope_layers=[1, 0, 1, 1],
                             max_position_embeddings=4096, **overrides)
    return families.random_model(config)


@torch.inference_mode()
def values_at(model, ids: list[int], start: int) -> list[torch.Tensor]:
    """Per layer, the values the model computes for ``ids`` at absolute positions start, start + 1, ... with nothing
    before them attended: fed after ``start`` fillers they cannot see (a mask per layer type), so the chunks and the
    temperature are the model's own at those positions (transformers counts both along the sequence; left padding
    would move its chunk boundaries with the padding)."""
    index = torch.arange(start + len(ids))
    own = (index[:, None] >= index[None, :]) & ((index[None, :] >= start) | (index[:, None] < start))
    chunk = model.config.attention_chunk_size
    masks = {"full_attention": own[None, None],
             "chunked_attention": (own & (index[:, None] // chunk == index[None, :] // chunk))[None, None]}
    out = model(input_ids=torch.tensor([[0] * start + ids]), attention_mask=masks, position_ids=index[None],
                use_cache=True, cache=transformers.DynamicCache())
    return [layer.values[..., start:, :] for layer in out.cache.layers]


CASES = {  # what moves: (config changes, the row's first position, whether the row's K/V stay the model's)
    "within the first chunk, below floor_scale": (dict(attention_chunk_size=1024, floor_scale=1024), 900, True),
    "a chunk boundary cuts the row": (dict(attention_chunk_size=8, attn_temperature_tuning=False), 17, False),
    "whole chunks later": (dict(attention_chunk_size=8, attn_temperature_tuning=False), 16, True),
    "past floor_scale: another temperature": (dict(attention_chunk_size=1024, floor_scale=8), 17, False),
    "inside the second chunk, temperature off": (dict(attention_chunk_size=1024, attn_temperature_tuning=False), 1030,
                                                 True),
    "inside the second chunk, temperature on": (dict(attention_chunk_size=1024, floor_scale=1024), 1030, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_row_moved_is_what_llama4_computes_only_where_no_chunk_or_temperature_differs(case):
    """Why milo caps Llama 4 at its first chunk: a block is encoded at the start of its row, and the same row at
    other positions gives other values past the first layer wherever a chunk boundary cuts it (off by about its own
    size) or the NoPE layer's temperature differs (off by about 2%); RoPE alone, with the norm after it, moves nothing
    (fp32 rounding at positions near 1,000). Only the first chunk below floor_scale − 1 is every row's."""
    change, start, kept = CASES[case]
    model = llama4(**change)
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    off = max(Deviation.of(b, a).relative for a, b in zip(values_at(model, ids, 0), values_at(model, ids, start)))
    assert (off < 1e-5) if kept else (off > 1e-2), off


def test_a_context_past_the_first_chunk_is_refused(tmp_path):
    """The tiny model's 1,024 positions are capped at its chunk of 512 and floor_scale − 1 = 511: the store records
    511, an encoding row or a query's context past it is refused naming the model's 511 positions."""
    loaded = families.tiny_model("llama4_text")
    assert loaded.identity["max_position_embeddings"] == first_chunk_positions(loaded.model.config) == 511
    with identity_store(loaded, tmp_path / "s") as store:
        engine = Engine(loaded, {"s": store})
        assert engine.max_positions == 511 and engine.plan("s", Request(QUERY))
        with pytest.raises(RequestError, match="exceeds the model's 511 positions"):
            engine.plan("s", Request(QUERY + " twice" * 70))
    long = families.demonstrations(4) + [Demonstration("card " * 120, "card", "long")]
    with pytest.raises(BuildError, match="exceeds the model's context of 511"):
        build_store(tmp_path / "long", loaded, long, families.TASK, BuildConfig(block_size=2), progress=False)


def test_the_temperature_milo_turns_off_is_the_models_below_floor_scale():
    """Below floor_scale − 1 the temperature is log1p(0) · attn_scale + 1 = 1 exactly: the model's logits with it
    on and off are equal to the bit; at floor_scale − 1 and past they are not (what turning it off would change)."""
    on = llama4(attention_chunk_size=1024, floor_scale=64)
    off = LoadedModel(model=llama4(attention_chunk_size=1024, floor_scale=64), tokenizer=None, identity={}).model
    assert not any(layer.self_attn.attn_temperature_tuning for layer in off.model.layers)
    ids = torch.randint(3, 300, (80,), generator=torch.Generator().manual_seed(2))[None]
    with torch.inference_mode():
        a, b = on(input_ids=ids).logits[0], off(input_ids=ids).logits[0]
    assert torch.equal(a[:63], b[:63]) and not torch.allclose(a[63:], b[63:], atol=1e-3)


def test_rows_packed_past_floor_scale_answer_as_each_alone(tmp_path):
    """The engine packs every row's query into one forward, so transformers' temperature, counted along that sequence,
    would scale the later rows' NoPE queries though each row sits below floor_scale: 16 rows of about 40 query tokens
    (640 packed, floor_scale 512), each row's logits the row's alone within 1e-4."""
    loaded = families.tiny_model("llama4_text")
    with identity_store(loaded, tmp_path / "s") as store:
        engine = Engine(loaded, {"s": store}, EngineSettings(k=2, prefill_chunk=4096), max_rows=16)
        plans = [engine.plan("s", Request(f"{QUERY} {i}"), block_ids=[i % 4, (i + 1) % 4]) for i in range(16)]
        assert sum(len(p.query_ids) for p in plans) > 512
        together = engine.logits(plans)
        for plan, rows in zip(plans, together):
            assert Deviation.of(rows, engine.logits([plan])[0]).relative <= 1e-4


def test_a_wrapped_llama4_checkpoint_is_loaded_as_its_text_model(tmp_path, capsys):
    """A tiny Llama 4 checkpoint (its vision tower beside the text model, saved in the released layout,
    language_model.model.*): loaded as Llama4ForCausalLM with its positions capped, answering text as the whole model,
    its image token and bounds kept to be refused; `milo check-model` passes on it."""
    from milo_infer.cli.main import main as milo
    from milo_infer.models import load_model, media_tokens

    vision = transformers.Llama4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=16, vision_output_dim=32,
                                             projector_input_dim=32, projector_output_dim=64)
    media = {"boi_token_index": 257, "image_token_index": 258, "eoi_token_index": 259}
    torch.manual_seed(0)
    whole = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(
        text_config=families.config("llama4_text").to_dict(), vision_config=vision.to_dict(), **media)).eval()
    whole.save_pretrained(tmp_path)
    families.tiny_model("llama4_text").tokenizer.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert type(loaded.model).__name__ == "Llama4ForCausalLM" and media_tokens(loaded.model.config) == media
    assert loaded.identity["max_position_embeddings"] == 511
    ids = torch.tensor([[5, 80, 23, 7, 190, 41, 3]])
    with torch.inference_mode():
        assert torch.allclose(loaded.model(input_ids=ids).logits, whole(input_ids=ids).logits, atol=1e-5)
    corpus = tmp_path / "corpus.jsonl"  # short demonstrations: the shipped corpus's rows pass 511 tokens
    corpus.write_text("".join(json.dumps({"input": d.input, "output": d.output}) + "\n"
                              for d in families.demonstrations(8)))
    assert milo(["check-model", str(tmp_path), "--corpus", str(corpus), "--shots", "8", "--block-size", "2"]) == 0
    assert "PASS" in capsys.readouterr().out.splitlines()[-1]
