"""Choosing each row's next token in one call for a whole step: greedy or sampled, each row with its own settings.

A row's `SamplingParams` say how: temperature 0 is greedy (the largest logit, the lowest id on ties, nan ranking
lowest: what milo always answered), else the logits over the temperature, cut to the top k, to the nucleus of
mass top_p and to tokens of at least min_p times the likeliest one's probability, and one token drawn. vLLM's
repetition penalty (the logit of every token the prompt or the answer holds divided by it where positive,
multiplied by it where not), then presence and frequency penalties (OpenAI's: subtracted from the logit of every
token the answer already holds, once and per time) apply either way, before any constraint. A row may allow only some tokens (a label's trie, a grammar's
mask: `milo_infer.runtime.decoding`); the rest are never chosen.

A row that samples draws one uniform number a step from its own generator (seeded by its request's ``seed``, or
at random) and takes the token at which the cumulative probability, in token id order, passes it: the answer
depends on the row's own logits and seed alone, never on the batch it runs in (logits that differ by a batch's
rounding change it only where the draw falls within that rounding of a token's edge).

Log probabilities are the model's own (its softmax over the raw logits, before penalties, temperature or
constraints), as vLLM reports them by default: the chosen token's and, where asked, the ``logprobs`` likeliest.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

MAX_LOGPROBS = 20  # top log probabilities a token may report, as OpenAI's API
NUCLEUS_START = 64  # candidates a nucleus is first looked for among (doubled until its mass reaches top_p)


@dataclass(frozen=True)
class SamplingParams:
    """How a row chooses its tokens; the defaults are greedy with no penalty and no log probabilities.
    ``top_k`` 0 keeps every token; ``logprobs`` None reports none, 0 the chosen token's, n also the n likeliest."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None

    def __post_init__(self):
        problems = [f"{name} {why}, got {value}" for name, value, ok, why in (
            ("temperature", self.temperature, 0 <= self.temperature, "must not be negative"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k, self.top_k >= 0, "must not be negative (0: every token)"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("presence_penalty", self.presence_penalty, -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", self.frequency_penalty, -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty, 0 < self.repetition_penalty <= 2, "must be in (0, 2]"),
            ("logprobs", self.logprobs, self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be between 0 and {MAX_LOGPROBS}")) if not ok]
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    def sample(self, index: int) -> "SamplingParams":
        """The settings of answer ``index`` of n to one request: its seed moved by the index (as vLLM's), so the n
        answers differ and each is reproducible."""
        return self if self.seed is None or index == 0 else replace(self, seed=self.seed + index)


GREEDY = SamplingParams()


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log probability and, where asked, the likeliest tokens' (id, log probability), likeliest
    first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)
class RowSampler:
    """One row's settings, its own random generator (None while it is greedy) and the token ids of its prompt
    (what the repetition penalty counts besides the answer; empty where it asks for none)."""

    params: SamplingParams = GREEDY
    generator: torch.Generator | None = field(default=None, repr=False)
    prompt: Sequence[int] = field(default=(), repr=False)

    def __post_init__(self):
        self.prompt = torch.tensor(sorted(set(self.prompt)), dtype=torch.long)  # each id once
        if not self.params.greedy:
            self.generator = torch.Generator()
            if self.params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.params.seed)


def choose(logits: torch.Tensor, samplers: Sequence[RowSampler], allowed: Sequence, answered: Sequence[list[int]]
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """Each row's next token from its logits [R, V] on the host: ``samplers[r]`` says how, ``allowed[r]`` which
    tokens may come (sorted token ids, a bool mask over the vocabulary, or None: any), ``answered[r]`` the tokens its
    answer holds so far (what the penalties count). Returns the tokens and each row's `TokenLogprob` (None where its
    params ask for none)."""
    if logits.dtype != torch.float64:  # a caller's float64 logits keep their precision: no ties made by rounding
        logits = logits.float()
    vocab = logits.shape[1]
    scores = torch.nan_to_num(logits, nan=float("-inf"))  # a copy: nan ranks lowest, never chosen
    for r, sampler in enumerate(samplers):
        p = sampler.params
        if p.repetition_penalty != 1 and (answered[r] or len(sampler.prompt)):
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[sampler.prompt[sampler.prompt < vocab]] = True
            seen[[t for t in answered[r] if t < vocab]] = True
            row = scores[r]
            scores[r] = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty),
                                    row)
        if (p.presence_penalty or p.frequency_penalty) and answered[r]:
            counts = torch.bincount(torch.tensor(answered[r]), minlength=vocab)[:vocab].float()
            scores[r] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    tokens = []
    for r, sampler in enumerate(samplers):
        row = scores[r]
        if allowed[r] is not None:
            row = torch.where(allowed_mask(allowed[r], vocab), row, float("-inf"))
        token = int(row.argmax()) if sampler.params.greedy else _draw(row, sampler)
        if row[token] == float("-inf"):  # nothing allowed has a finite score: the lowest allowed id
            token = first_allowed(allowed[r])
        tokens.append(token)
    return tokens, _logprobs(logits, samplers, tokens)


def allowed_mask(allowed, vocab: int) -> torch.Tensor:
    """bool [vocab] of the tokens ``allowed`` (sorted ids, or a bool mask, which may be shorter or longer than
    ``vocab``: a tokenizer's vocabulary and the model's output width differ by padding)."""
    if isinstance(allowed, torch.Tensor):
        mask = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, len(allowed))
        mask[:n] = allowed[:n]
        return mask
    if allowed and allowed[-1] >= vocab:
        raise ValueError(f"logits cover {vocab} tokens, but token {allowed[-1]} is allowed")
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[list(allowed)] = True
    return mask


def first_allowed(allowed) -> int:
    if allowed is None:
        return 0
    if isinstance(allowed, torch.Tensor):
        return int(allowed.nonzero()[0]) if allowed.any() else 0
    return allowed[0] if allowed else 0


def _draw(scores: torch.Tensor, sampler: RowSampler) -> int:
    """One token drawn from ``scores`` [V] over the temperature, cut by min_p, then top_k, then top_p (each on
    what the one before left, as vLLM's sampler): the first token, in id order, whose cumulative probability passes
    one uniform draw of the row's generator."""
    p = sampler.params
    x = scores / p.temperature
    if p.min_p:
        probs = torch.softmax(x, 0)
        x = torch.where(probs < p.min_p * probs.max(), float("-inf"), x)
    if 0 < p.top_k < len(x):
        x = torch.where(x < x.topk(p.top_k).values[-1], float("-inf"), x)
    if p.top_p < 1:
        x = _nucleus(x, p.top_p)
    cumulative = torch.softmax(x, 0).cumsum(0)
    target = torch.rand((), generator=sampler.generator) * cumulative[-1]
    return min(int(torch.searchsorted(cumulative, target, right=True)), len(x) - 1)


def _nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """``x`` with every token outside the smallest set of likeliest tokens whose probability reaches ``top_p`` at
    -inf. The set is looked for among the likeliest few first (a nucleus is small where a model is sure), so a step
    never sorts the whole vocabulary unless the nucleus needs it."""
    probs, n = torch.softmax(x, 0), NUCLEUS_START
    while True:
        values, ids = probs.topk(min(n, len(x)))
        mass = values.cumsum(0)
        if mass[-1] >= top_p or n >= len(x):
            kept = ids[:int(torch.searchsorted(mass, torch.tensor(top_p))) + 1]
            keep = torch.zeros(len(x), dtype=torch.bool)
            keep[kept] = True
            return torch.where(keep, x, float("-inf"))
        n *= 4


def _logprobs(logits: torch.Tensor, samplers: Sequence[RowSampler], tokens: list[int]) -> list[TokenLogprob | None]:
    """The model's log probabilities of each chosen token, and of the likeliest ones where asked, from the raw
    logits: one log-sum-exp and one top-n over the rows that ask."""
    asking = [r for r, s in enumerate(samplers) if s.params.logprobs is not None]
    entries: list[TokenLogprob | None] = [None] * len(samplers)
    if not asking:
        return entries
    rows = logits[asking]
    norm = torch.logsumexp(rows, 1)
    most = max(samplers[r].params.logprobs for r in asking)
    top_values, top_ids = rows.topk(most, 1) if most else (rows[:, :0], rows[:, :0].long())
    for i, r in enumerate(asking):
        n = samplers[r].params.logprobs
        top = tuple(zip(top_ids[i, :n].tolist(), (top_values[i, :n] - norm[i]).tolist()))
        entries[r] = TokenLogprob(tokens[r], float(rows[i, tokens[r]] - norm[i]), top)
    return entries
