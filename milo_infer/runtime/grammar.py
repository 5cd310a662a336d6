"""Structured output: an answer held to a JSON schema, a regular expression or an EBNF grammar, one grammar matcher
per row, masking its logits each step.

xgrammar does the grammar (milo's choice among the grammar libraries that install beside the CPU torch: its masks
took 3-8 µs a token against llguidance's 45-65 µs and outlines-core's 0.4 ms, and it compiled a schema in ~6 ms
against outlines-core's 0.4 s, on this machine's CPU with the default model's 49,152-token vocabulary; docs/
benchmarks.md). A grammar is compiled once per tokenizer and kept (`compile_grammar`, at planning: one xgrammar
refuses is a `RequestError`), and each row holds its own matcher (`GrammarDecoder`). JSON is compact (no
whitespace between its tokens, which a small model may otherwise repeat for as long as its budget lasts; no
property a schema does not name, xgrammar's strict mode) and every answer ends with the tokenizer's eos, which its
text leaves out. xgrammar is imported at the first grammar: a server that is never asked for one never pays its
import.
"""
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


GRAMMAR_KINDS = {"json": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar"}  # what compiles


@lru_cache(maxsize=256)
def compile_grammar(tokenizer, kind: str, source: str) -> "Grammar":
    """``source`` (a JSON schema's text, a regular expression or an EBNF grammar whose rule ``root`` is the answer,
    as ``kind`` says) compiled for ``tokenizer``, kept for the next request that sends it."""
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"no grammar kind {kind!r}: one of {', '.join(GRAMMAR_KINDS)}")
    compiler = _compiler(tokenizer)
    try:
        if kind == "json":
            json.loads(source)
            compiled = compiler.compile_json_schema(source, any_whitespace=False, separators=(",", ":"))
        elif kind == "regex":
            compiled = compiler.compile_regex(source)
        else:
            compiled = compiler.compile_grammar(source)
    except (ValueError, RuntimeError) as e:  # xgrammar raises either on a source it cannot compile
        raise RequestError(f"the {GRAMMAR_KINDS[kind]} cannot be used: {e}") from None
    return Grammar(compiled, tokenizer)


class Grammar:
    """A compiled grammar: each row answering to it gets a decoder of its own (``decoder``)."""

    def __init__(self, compiled, tokenizer):
        self.compiled, self.tokenizer = compiled, tokenizer

    def decoder(self, tokenizer, limit: int) -> "GrammarDecoder":
        return GrammarDecoder(self, tokenizer, limit)


class GrammarDecoder:
    """One row's structured answer: at each step only the tokens its grammar allows may come; done once the grammar
    took eos (``stop`` "eos") or at ``limit`` tokens (``stop`` "length": the answer may be cut short)."""

    def __init__(self, grammar: Grammar, tokenizer, limit: int):
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
            raise ValueError(f"token {token} does not follow the grammar here")
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
