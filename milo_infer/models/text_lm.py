"""`TextModelForCausalLM`: a text model transformers defines no causal LM for, as one (`multimodal.causal_lm_class`)."""
from __future__ import annotations

import torch
from transformers import AutoModel, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep


class TextModelForCausalLM(PreTrainedModel, GenerationMixin):
    """``config``'s text model (transformers' ``AutoModel`` of it) and a vocabulary head: the causal LM transformers
    does not define for a multimodal checkpoint's text model. Its weights load from a checkpoint through
    `loading.TEXT_WEIGHTS`; its forward is a causal LM's, the cache under the text model's own keyword."""

    base_model_prefix = "model"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _supports_sdpa = _supports_flash_attn = _supports_flex_attn = _supports_attention_backend = True

    def __init__(self, config):
        super().__init__(config)
        self.model = AutoModel.from_config(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def from_config(cls, config, **kwargs) -> "TextModelForCausalLM":
        """A new one of ``config``, as ``AutoModelForCausalLM.from_config`` makes one (`causal_lm_class` answers
        either)."""
        return cls._from_config(config, **kwargs)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, logits_to_keep: int | torch.Tensor = 0, **kwargs) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        logits = self.lm_head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
        return CausalLMOutputWithPast(logits=logits, cache=out.cache)
