"""A multimodal checkpoint's text model as a text-only causal LM, and the media tokens milo refuses in its text.

milo serves text: a checkpoint wrapping a text model (``text_config``) is judged and loaded as that text model
(`loading.read_config`). Where transformers has a causal LM for the text model's type (Mistral 3's is Mistral's)
that is what loads; where it has none (Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's text models live only inside their
``...ForConditionalGeneration``), `text_lm.TextModelForCausalLM` is one: the text model transformers has, with the
checkpoint's ``lm_head`` beside it. Their multimodal RoPE turns each frequency by one of three position rows
(time, height, width); for text the rows are equal, so it is one rotation per position, the standard one.

A token that stands for an image, a video or their bounds (the wrapper config's ``image_token_id``,
``vision_start_token_id``, ...) means nothing without the vision tower milo does not run: `read_config` keeps the
wrapper's on the text config (`MEDIA_TOKENS`, read by `media_tokens`), and a corpus or a query that tokenizes to one
is refused (`media_problem`).
"""
from __future__ import annotations

MEDIA_TOKENS = "milo_media_tokens"  # the text config's attribute: {wrapper field name: token id}
TEXT_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id")  # not media


def causal_lm_class(config) -> type:
    """What loads ``config`` as a causal LM (``from_config``, ``from_pretrained``): transformers'
    ``AutoModelForCausalLM``, or `text_lm.TextModelForCausalLM` for a text model transformers has no causal LM of."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or type(config) not in MODEL_MAPPING:
        return AutoModelForCausalLM
    from .text_lm import TextModelForCausalLM  # transformers' modeling code, imported only for such a model

    return TextModelForCausalLM


def media_token_ids(wrapper) -> dict[str, int]:
    """The token ids a multimodal wrapper config names beside its text model's (every ``*_token_id`` or
    ``*_token_index`` field but the text tokens, bos, eos, pad, ...): image, video and audio tokens and their bounds."""
    fields = wrapper.to_dict()
    return {name: value for name, value in sorted(fields.items()) if name.endswith(("_token_id", "_token_index"))
            and name not in TEXT_TOKENS and isinstance(value, int) and not isinstance(value, bool)}


def media_tokens(config) -> dict[str, int]:
    """The media token ids `read_config` kept on a wrapped text model's ``config`` ({} for any other model)."""
    return dict(getattr(config, MEDIA_TOKENS, None) or {})


def media_problem(media: dict[str, int], ids, what: str) -> str | None:
    """Why ``ids`` (the token ids of ``what``: a query, a demonstration) cannot be answered as text by a model whose
    media tokens are ``media`` (`media_tokens`): the first media token among them, named; None when there is none."""
    names = {token: name for name, token in media.items()}
    found = next((int(t) for t in ids if int(t) in names), None)
    if found is None:
        return None
    return (f"{what} holds token {found}, the model's {names[found]}: milo serves this multimodal checkpoint's text "
            "model alone, and an image, a video or their bounds mean nothing without its vision tower")
