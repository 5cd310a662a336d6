"""Greedy decoding, free and label-constrained, one row at a time, independent of the model.

A decoder (:class:`LabelDecoder`, :class:`GreedyDecoder`) takes the logits for the next position,
``push(logits) -> token``, until ``done``; the batched engine keeps one per row of a batch, feeds
each chosen token back to the model, and stops running a row once its decoder is done. Logits may be
numpy arrays, lists or torch tensors on any device.

Classification tasks use :class:`LabelDecoder` over a :class:`LabelTrie`: the answer is forced to
be one of the label strings, so accuracy measures the model's choice rather than its formatting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Decoded:
    """A decoding result.

    ``token_ids`` are all tokens chosen, in order, including the one that
    ended decoding (label terminator or eos); ``stop`` says why it ended:
    ``"label"``, ``"stop_string"``, ``"eos"`` or ``"length"``.
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


def _argmax(logits: np.ndarray) -> int:
    """Index of the largest logit, the first on ties; nan ranks lowest.

    np.argmax would return the first nan, letting one corrupt logit decide.
    """
    return int(np.argmax(np.where(np.isnan(logits), -np.inf, logits)))


def _complete(text: str) -> str:
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

    def label(self, prefix_ids: Sequence[int]) -> str | None:
        """The label spelled by ``prefix_ids`` (terminator optional), or None."""
        prefix = tuple(int(t) for t in prefix_ids)
        if prefix and prefix[-1] in self.terminators:
            prefix = prefix[:-1]
        return self._label_at.get(prefix)


class LabelDecoder:
    """One row's label-constrained greedy choice, a token at a time (the batched engine keeps one per row).

    ``push(logits)`` takes the logits for the next position and returns the chosen token; once
    ``done``, ``result()`` is the answer. At each step the logits are masked to the tokens the trie
    allows and the best one is taken (the lowest id on exact ties); when only one token is allowed the
    logits are not read. ``limit`` (default: what the longest label needs) may be smaller: decoding
    then stops there with ``stop == "length"`` and the partial label's text.
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

    def push(self, raw_logits) -> int:
        allowed = self.trie.allowed(self.ids)
        if len(allowed) == 1:
            choice = allowed[0]
        else:
            logits = _as_logits(raw_logits)
            if allowed[-1] >= len(logits):
                raise ValueError(f"logits cover {len(logits)} tokens, but label token {allowed[-1]} is allowed")
            choice = allowed[_argmax(logits[allowed])]
        self.ids.append(choice)
        if choice in self.trie.terminators:
            self.stop = "label"
        elif len(self.ids) >= self.limit:
            self.stop = "length"
        return choice

    def text(self) -> str:
        """The answer so far: the label once closed, else the decoded tokens (needs a tokenizer)."""
        label = self.trie.label(self.ids)
        if label is not None and self.stop == "label":
            return label
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True).strip()
        return text if self.done else _complete(text)

    def result(self) -> Decoded:
        return Decoded(text=self.text(), token_ids=list(self.ids), stop=self.stop)


class GreedyDecoder:
    """One row's plain greedy decoding until eos, a stop string, or ``max_new_tokens``.

    The text is cut just before the earliest stop string found, since stop strings mark where the
    answer ends (e.g. the start of the next demonstration), not part of it; eos is never part of it.
    ``text()`` while decoding holds back any tail that could still become a stop string, and a character
    whose bytes have not all come, so text streamed from it is never taken back.
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str], max_new_tokens: int) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if any(s == "" for s in stop_strings):
            raise ValueError("stop strings must not be empty")
        self.tokenizer, self.stop_strings, self.max_new_tokens = tokenizer, list(stop_strings), max_new_tokens
        self.ids: list[int] = []
        self.stop: str | None = None
        self._text = ""

    @property
    def done(self) -> bool:
        return self.stop is not None

    def push(self, raw_logits) -> int:
        choice = _argmax(_as_logits(raw_logits))
        self.ids.append(choice)
        if choice == self.tokenizer.eos_token_id:
            self._text, self.stop = self.tokenizer.decode(self.ids[:-1], skip_special_tokens=True), "eos"
            return choice
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        if cuts:
            self._text, self.stop = text[: min(cuts)], "stop_string"
        else:
            self._text = text
            if len(self.ids) == self.max_new_tokens:
                self.stop = "length"
        return choice

    def text(self) -> str:
        if self.done:
            return self._text
        text = _complete(self._text)
        held = max((n for s in self.stop_strings for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        return text[: len(text) - held]

    def result(self) -> Decoded:
        return Decoded(self._text, list(self.ids), self.stop)
