"""Decoding one row's answer, a token at a time, independent of the model.

A decoder (:class:`LabelDecoder`, :class:`FreeDecoder`, `milo_infer.runtime.grammar.GrammarDecoder`) says which
tokens may come next (``allowed()``: sorted ids, a bool mask, or None for any) and takes the token chosen
(``accept(token)``) until ``done``; the batched engine keeps one per row and chooses every row's token of a step at
once (`milo_infer.runtime.sampling.choose`: greedy or sampled, each row with its own settings). ``push(logits)``
is one greedy step, for a caller that drives a decoder alone. Logits may be numpy arrays, lists or torch tensors
on any device.

Classification tasks use :class:`LabelDecoder` over a :class:`LabelTrie`: the answer is forced to
be one of the label strings, so accuracy measures the model's choice rather than its formatting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .sampling import GREEDY, RowSampler, choose

@dataclass(frozen=True)
class Decoded:
    """A decoding result.

    ``token_ids`` are all tokens chosen, in order, including the one that
    ended decoding (label terminator, eos or a stop token); ``stop`` says why it ended:
    ``"label"``, ``"stop_string"``, ``"eos"``, ``"stop_token"`` or ``"length"``.
    """

    text: str
    token_ids: list[int]
    stop: str


def _as_logits(raw: object) -> np.ndarray:
    """Accept numpy arrays, lists, or torch tensors (any device) as 1-D logits."""
    if hasattr(raw, "detach"):  # torch.Tensor, without importing torch here
        raw = raw.detach().float().cpu().numpy()
    logits = np.asarray(raw, dtype=np.float64)
    if logits.ndim != 1:
        raise ValueError(
            f"logits must be 1-D over the vocabulary, got shape {logits.shape}"
        )
    return logits


def greedy_step(decoder, raw_logits) -> int:
    """``decoder``'s greedy choice among the tokens it allows (the largest logit, the lowest id on ties, nan
    lowest), accepted."""
    logits = torch.from_numpy(_as_logits(raw_logits))[None]
    (token,), _ = choose(logits, [RowSampler(GREEDY)], [decoder.allowed()], [decoder.ids])
    decoder.accept(token)
    return token


def complete(text: str) -> str:
    """``text`` less a trailing U+FFFD: while decoding goes on, that is a character whose bytes byte-level BPE
    split across tokens and whose other bytes are still to come (its first bytes alone decode to U+FFFD);
    once they have come, it decodes to the character."""
    return text.rstrip("\ufffd")


def _single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


class LabelTrie:
    """Prefix tree over the token sequences of the allowed labels.

    Each label is tokenized as it appears after the prompt's cue (``prefix``
    + label, e.g. ``"Intent:"`` then ``" card lost"``), because BPE tokenizes
    a leading space differently from a bare word. A completed label is closed
    by a terminator token: the newline token (demonstrations are one per
    line) and, if the tokenizer has one, eos. The terminator is what lets a
    label that is a token-prefix of another (``" card"`` / ``" card lost"``)
    still be chosen: at that node both the terminator and the continuation
    are allowed, and the model decides.
    """

    def __init__(self, tokenizer, labels: Sequence[str], prefix: str = " ") -> None:
        if not labels:
            raise ValueError("need at least one label")
        terminators = {_single_token(tokenizer, "\n"), tokenizer.eos_token_id} - {None}
        if not terminators:
            raise ValueError("tokenizer has neither a single newline token nor an eos token")
        self.terminators = frozenset(int(t) for t in terminators)

        self._children: dict[tuple[int, ...], set[int]] = {(): set()}
        self._label_at: dict[tuple[int, ...], str] = {}
        for label in labels:
            if not label.strip():
                raise ValueError(f"labels must not be blank, got {label!r}")
            if "\n" in label:
                raise ValueError(
                    f"labels must not contain a newline (it ends a label), got {label!r}"
                )
            ids = tuple(tokenizer.encode(prefix + label, add_special_tokens=False))
            if self.terminators & set(ids):
                raise ValueError(f"label {label!r} contains a terminator token")
            if ids in self._label_at:
                raise ValueError(
                    f"labels {self._label_at[ids]!r} and {label!r} tokenize identically"
                )
            self._label_at[ids] = label
            for depth in range(len(ids)):
                self._children.setdefault(ids[:depth], set()).add(ids[depth])
                self._children.setdefault(ids[: depth + 1], set())

        self.labels = list(self._label_at.values())
        # Longest label plus its terminator: enough new tokens to finish any path.
        self.max_tokens = max(len(ids) for ids in self._label_at) + 1

    def allowed(self, prefix_ids: Sequence[int]) -> list[int]:
        """Token ids that may follow ``prefix_ids`` (sorted); ``[]`` once a label is closed."""
        prefix = tuple(int(t) for t in prefix_ids)
        if prefix and prefix[-1] in self.terminators and prefix[:-1] in self._label_at:
            return []
        if prefix not in self._children:
            raise ValueError(f"{list(prefix)} is not a prefix of any label")
        nxt = set(self._children[prefix])
        if prefix in self._label_at:
            nxt |= self.terminators
        return sorted(nxt)

    def decoder(self, tokenizer, limit: int | None = None) -> "LabelDecoder":
        return LabelDecoder(self, tokenizer, limit)

    def label(self, prefix_ids: Sequence[int]) -> str | None:
        """The label spelled by ``prefix_ids`` (terminator optional), or None."""
        prefix = tuple(int(t) for t in prefix_ids)
        if prefix and prefix[-1] in self.terminators:
            prefix = prefix[:-1]
        return self._label_at.get(prefix)


class LabelDecoder:
    """One row's label-constrained answer, a token at a time (the batched engine keeps one per row).

    At each step only the tokens the trie allows may come (when only one is allowed, it comes whatever the logits
    say); once ``done``, ``result()`` is the answer. ``limit`` (default: what the longest label needs) may be
    smaller: decoding then stops there with ``stop == "length"`` and the partial label's text.
    """

    def __init__(self, trie: LabelTrie, tokenizer=None, limit: int | None = None) -> None:
        self.trie, self.tokenizer = trie, tokenizer
        self.limit = trie.max_tokens if limit is None else limit
        if self.limit < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.limit}")
        self.ids: list[int] = []
        self.stop: str | None = None

    @property
    def done(self) -> bool:
        return self.stop is not None

    def allowed(self) -> list[int]:
        return self.trie.allowed(self.ids)

    def accept(self, choice: int) -> None:
        self.ids.append(choice)
        if choice in self.trie.terminators:
            self.stop = "label"
        elif len(self.ids) >= self.limit:
            self.stop = "length"

    def push(self, raw_logits) -> int:
        return greedy_step(self, raw_logits)

    def text(self) -> str:
        """The answer so far: the label once closed, else the decoded tokens (needs a tokenizer)."""
        label = self.trie.label(self.ids)
        if label is not None and self.stop == "label":
            return label
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True).strip()
        return text if self.done else complete(text)

    def result(self) -> Decoded:
        return Decoded(text=self.text(), token_ids=list(self.ids), stop=self.stop)


@dataclass(frozen=True)
class Ending:
    """Where a free-form answer may end besides its stop strings and budget (vLLM's fields of those names):
    ``stop_token_ids`` end it as eos does; none of them (eos included) may come, nor a stop string end it, before
    ``min_tokens``; ``ignore_eos`` lets eos come without ending it; ``include_stop`` keeps the request's stop string
    or the stop token that ended it in its text; ``skip_special_tokens`` False keeps special tokens' text."""

    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        if self.min_tokens < 0 or any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"min_tokens and stop token ids must not be negative, got {self.min_tokens} and "
                             f"{list(self.stop_token_ids)}")

    @property
    def asks(self) -> tuple[str, ...]:
        """The fields that ask for more than the default ending (a structured answer's form cannot honour them)."""
        return tuple(name for name, value in (("stop_token_ids", self.stop_token_ids), ("min_tokens", self.min_tokens),
                                              ("ignore_eos", self.ignore_eos)) if value)


UNTIL_EOS = Ending()


class FreeDecoder:
    """One row's free-form answer, any token allowed, until eos, a stop string or token, or ``max_new_tokens``.

    The text is cut just before the earliest stop string found, since stop strings mark where the answer ends
    (e.g. the start of the next demonstration), not part of it; eos and stop tokens are never part of it. The
    request's own ``stop_strings`` (and stop token) stay in it where ``ending.include_stop`` asks; ``markers``
    (the template's: `planning.STOP_STRINGS`) always cut. ``text()`` while decoding holds back any tail that could
    still become a stop string, and a character whose bytes have not all come, so text streamed from it is never
    taken back. Until ``ending.min_tokens`` tokens have come, eos and the stop tokens are masked out and no stop
    string ends the answer (one found then never does: as vLLM's, a stop string must end past that point).
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str], max_new_tokens: int, ending: Ending = UNTIL_EOS,
                 markers: Sequence[str] = ()) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if any(s == "" for s in [*stop_strings, *markers]):
            raise ValueError("stop strings must not be empty")
        self.tokenizer, self.max_new_tokens, self.ending = tokenizer, max_new_tokens, ending
        self.kept = frozenset(stop_strings) if ending.include_stop else frozenset()
        self.stop_strings = list(dict.fromkeys([*stop_strings, *markers]))
        eos = tokenizer.eos_token_id
        self.ends = frozenset(ending.stop_token_ids) | ({eos} if eos is not None and not ending.ignore_eos else set())
        self.ids: list[int] = []
        self.stop: str | None = None
        self._text = ""
        self._floor = 0  # characters of text a stop string must end past (those of the first min_tokens tokens)
        self._without_ends = None  # bool [vocabulary]: every token but eos and the stop tokens (min_tokens)

    @property
    def done(self) -> bool:
        return self.stop is not None

    def allowed(self) -> torch.Tensor | None:
        if len(self.ids) >= self.ending.min_tokens or not self.ends:
            return None
        if self._without_ends is None:
            self._without_ends = torch.ones(max(len(self.tokenizer), max(self.ends) + 1), dtype=torch.bool)
            self._without_ends[list(self.ends)] = False
        return self._without_ends

    def push(self, raw_logits) -> int:
        return greedy_step(self, raw_logits)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.ending.skip_special_tokens)

    def accept(self, choice: int) -> None:
        self.ids.append(choice)
        past_min = len(self.ids) > self.ending.min_tokens
        if choice in self.ends and past_min:
            kept = choice != self.tokenizer.eos_token_id and self.ending.include_stop
            self._text = self._decode(self.ids if kept else self.ids[:-1])
            self.stop = "eos" if choice == self.tokenizer.eos_token_id else "stop_token"
            return
        text = self._decode(self.ids)
        if not past_min:
            self._floor = len(text)
        found = [(i, s) for s in self.stop_strings for i in [text.find(s, max(0, self._floor - len(s) + 1))]
                 if i >= 0] if past_min else []
        if found:
            at, first = min(found, key=lambda f: f[0])
            self._text, self.stop = text[: at + len(first) if first in self.kept else at], "stop_string"
        else:
            self._text = text
            if len(self.ids) == self.max_new_tokens:
                self.stop = "length"

    def text(self) -> str:
        if self.done:
            return self._text
        text = complete(self._text)
        held = max((n for s in self.stop_strings for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        return text[: len(text) - held]

    def result(self) -> Decoded:
        return Decoded(self._text, list(self.ids), self.stop)
