"""Structured output: an answer held to a JSON schema, one grammar matcher per row, masking its logits each step.

xgrammar does the grammar (milo's choice among the grammar libraries that install beside the CPU torch: its masks
took 3-8 µs a token against llguidance's 45-65 µs and outlines-core's 0.4 ms, and it compiled a schema in ~6 ms
against outlines-core's 0.4 s, on this machine's CPU with the default model's 49,152-token vocabulary; docs/
benchmarks.md). A schema is compiled once per tokenizer and kept (`compile_schema`, at planning: a schema xgrammar
refuses is a `RequestError`), and each row holds its own matcher (`SchemaDecoder`). The JSON is compact (no
whitespace between its tokens, which a small model may otherwise repeat for as long as its budget lasts) and ends
with the tokenizer's eos, which the answer's text leaves out. xgrammar is imported at the first schema: a server
that is never asked for one never pays its import.
"""
from __future__ import annotations

import json
from functools import lru_cache

import torch

from .decoding import Decoded, complete
from .errors import RequestError

_BITS = torch.arange(32, dtype=torch.int32)


@lru_cache(maxsize=8)
def _compiler(tokenizer):
    """xgrammar's compiler for ``tokenizer`` (its vocabulary read once, ~0.25 s)."""
    import xgrammar

    return xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)),
                                    max_threads=1)


def compile_schema(tokenizer, schema: str) -> "SchemaGrammar":
    """``schema`` (JSON text) compiled for ``tokenizer``, kept for the next request that sends it."""
    return _compiled(tokenizer, schema)


@lru_cache(maxsize=256)
def _compiled(tokenizer, schema: str) -> "SchemaGrammar":
    try:
        json.loads(schema)
        compiled = _compiler(tokenizer).compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
    except (ValueError, RuntimeError) as e:  # xgrammar raises either on a schema it cannot compile
        raise RequestError(f"the JSON schema cannot be used: {e}") from None
    return SchemaGrammar(compiled, tokenizer)


class SchemaGrammar:
    """A compiled schema: each row answering to it gets a decoder of its own (``decoder``)."""

    def __init__(self, compiled, tokenizer):
        self.compiled, self.tokenizer = compiled, tokenizer

    def decoder(self, tokenizer, limit: int) -> "SchemaDecoder":
        return SchemaDecoder(self, tokenizer, limit)


class SchemaDecoder:
    """One row's JSON answer: at each step only the tokens its grammar allows may come; done once the grammar took
    eos (``stop`` "eos") or at ``limit`` tokens (``stop`` "length": the JSON may be cut short)."""

    def __init__(self, grammar: SchemaGrammar, tokenizer, limit: int):
        import xgrammar

        if limit < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {limit}")
        self.tokenizer, self.limit = tokenizer, limit
        self.matcher = xgrammar.GrammarMatcher(grammar.compiled)
        self.bitmask = xgrammar.allocate_token_bitmask(1, len(tokenizer))
        self.ids: list[int] = []
        self.stop: str | None = None

    @property
    def done(self) -> bool:
        return self.stop is not None

    def allowed(self) -> torch.Tensor:
        """bool [vocabulary]: the tokens the grammar takes next."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        return ((self.bitmask[0, :, None] >> _BITS) & 1).flatten().bool()[:len(self.tokenizer)]

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise ValueError(f"token {token} does not follow the JSON schema here")
        self.ids.append(token)
        if self.matcher.is_terminated():
            self.stop = "eos"
        elif len(self.ids) >= self.limit:
            self.stop = "length"

    def text(self) -> str:
        ids = self.ids[:-1] if self.stop == "eos" else self.ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text if self.done else complete(text)

    def result(self) -> Decoded:
        return Decoded(self.text(), list(self.ids), self.stop)
