"""A multimodal checkpoint's text model (issue 60): tiny random Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE
checkpoints saved as transformers saves them (Qwen2-VL's and Qwen2.5-VL's in their released layout, ``model.layers``
beside ``visual``; Qwen3-VL's under ``model.language_model``) and loaded through `load_model` as their text model
(`milo_infer.models.multimodal`): it answers text as the whole multimodal model does, passes `milo check-model`, and a
corpus or a query holding an image or video token is refused (a 400 from `milo serve`)."""
import httpx
import pytest
import torch

from milo_infer.bench.synthetic_model import byte_tokenizer
from milo_infer.building.builder import build_store
from milo_infer.building.config import BuildConfig, BuildError
from milo_infer.cli.main import main as milo
from milo_infer.models import load_model, media_tokens
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.errors import RequestError
from milo_infer.runtime.planning import Request
from milo_infer.tasks.corpus import Demonstration
from milo_store import CompressionConfig, MiloStore
from tests.infer import families
from tests.infer.server.serving import serving

# the wrapper's media tokens, as the tokenizer's special tokens after the byte tokenizer's 257 ids
MEDIA = {"vision_start_token_id": 257, "image_token_id": 258, "video_token_id": 259, "vision_end_token_id": 260}
SPECIAL = ["<|vision_start|>", "<|image_pad|>", "<|video_pad|>", "<|vision_end|>"]
QWEN3_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    num_position_embeddings=16, deepstack_visual_indexes=[0])
QWEN3_5_VISION = {k: v for k, v in QWEN3_VISION.items() if k != "deepstack_visual_indexes"}
WRAPPERS = {  # wrapper model type -> its config class, its vision config class and a one-block vision tower
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLVisionConfig",
                 dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLVisionConfig",
                   dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                        fullatt_block_indexes=[0])),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLVisionConfig", QWEN3_VISION),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeVisionConfig", QWEN3_VISION),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5VisionConfig", QWEN3_5_VISION),  # hybrids: Gated DeltaNet text models
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeVisionConfig", QWEN3_5_VISION),
}


def wrapped_dir(kind: str, path) -> str:
    """A tiny ``kind`` checkpoint around its text family's tiny config (`families.TINY`), with a tokenizer whose
    special tokens are its media tokens."""
    import transformers

    config, vision_config, vision = WRAPPERS[kind]
    wrapper = getattr(transformers, config)(text_config=families.config(f"{kind}_text").to_dict(),
                                            vision_config=getattr(transformers, vision_config)(**vision).to_dict(),
                                            tie_word_embeddings=False, **MEDIA)
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(wrapper).save_pretrained(path)
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    assert tokenizer.convert_tokens_to_ids(SPECIAL) == sorted(MEDIA.values())
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    return wrapped_dir("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl"))


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_a_wrapped_checkpoint_answers_text_as_its_multimodal_model(kind, tmp_path):
    from transformers import AutoModelForImageTextToText

    path = wrapped_dir(kind, tmp_path)
    loaded, whole = load_model(path), AutoModelForImageTextToText.from_pretrained(path).eval()
    assert loaded.identity["model_type"] == f"{kind}_text" and media_tokens(loaded.model.config) == MEDIA
    ids = torch.tensor([[5, 80, 23, 7, 190, 41, 3]])
    with torch.inference_mode():
        ours, theirs = loaded.model(input_ids=ids).logits, whole(input_ids=ids).logits
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_check_model_passes_on_a_wrapped_checkpoint(qwen3_vl, capsys):
    assert milo(["check-model", qwen3_vl]) == 0
    assert "PASS" in capsys.readouterr().out.splitlines()[-1]


def test_a_demonstration_holding_an_image_token_is_refused(qwen3_vl, tmp_path):
    demos = families.demonstrations(4) + [Demonstration("my card <|image_pad|> twice", "card", "photo")]
    with pytest.raises(BuildError, match="demonstration 'photo' holds token 258, the model's image_token_id"):
        build_store(tmp_path / "s", load_model(qwen3_vl), demos, families.TASK, BuildConfig(block_size=2),
                    progress=False)


def test_a_query_holding_a_video_token_is_refused_with_a_400(qwen3_vl, tmp_path):
    loaded = load_model(qwen3_vl)
    config = BuildConfig(block_size=2, compression=CompressionConfig(ratio=1.0, codec="identity", dtype="float32"))
    build_store(tmp_path / "s", loaded, families.demonstrations(8), families.TASK, config, progress=False)
    with MiloStore.open(tmp_path / "s") as store:
        engine = Engine(loaded, {"s": store})
        assert engine.plan("s", Request("my card was charged twice")).query_ids
        with pytest.raises(RequestError, match="the query holds token 259, the model's video_token_id"):
            engine.plan("s", Request("my card <|video_pad|> was charged"))
        with serving(engine) as served:
            reply = httpx.post(f"{served.base}/v1/completions", timeout=60,
                               json={"model": "s", "prompt": "<|vision_start|> my card"})
    assert reply.status_code == 400 and "vision_start_token_id" in reply.json()["error"]["message"], reply.text


def test_a_wrapped_gemma4_checkpoint_answers_text_as_its_multimodal_model(tmp_path, capsys):
    """Gemma 4 (its per-layer shapes, K = V and shared layers inside a checkpoint with a vision tower): loaded as its
    text model (`gemma4_text`), it answers text as the whole model does and passes `milo check-model`."""
    import transformers

    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    wrapper = transformers.Gemma4Config(text_config=families.config("gemma4_text").to_dict(),
                                        vision_config=vision.to_dict(), tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(wrapper).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    loaded, whole = load_model(tmp_path), transformers.AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    assert loaded.identity["model_type"] == "gemma4_text" and loaded.identity["layers"][2]["kind"] == "shared"
    ids = torch.tensor([[5, 80, 23, 7, 190, 41, 3]])
    with torch.inference_mode():
        ours, theirs = loaded.model(input_ids=ids).logits, whole(input_ids=ids).logits
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    assert milo(["check-model", str(tmp_path)]) == 0
    assert "PASS" in capsys.readouterr().out.splitlines()[-1]
