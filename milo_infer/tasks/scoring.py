"""Judging a model's answer against the reference.

Kept lenient about surface form (case, spacing, ``card_lost`` vs ``card
lost``, a trailing full stop, thousands separators) so that scores measure
whether the model knew the answer, and strict about everything else.
"""

from __future__ import annotations

import math
import re
import unicodedata
from typing import Literal

REL_TOL = 1e-4

# A number with an optional sign and currency sign: 1,234.5 / -3.5 / .5 / $12.
# The look-behind keeps "3-4" from reading as -4 and "v2.1" from reading as 2.1.
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-\u2212])?\$?"
    r"(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
    r"(?!\d)"
)
# Where a model (or a GSM8K reference) states its final answer explicitly.
_MARKER = re.compile(r"####|answer\s+is", re.IGNORECASE)


def normalize_label(s: str) -> str:
    """Canonical form of a class label: lowercase, underscores as spaces,
    whitespace collapsed, no surrounding whitespace or trailing punctuation."""
    s = " ".join(s.replace("_", " ").lower().split())
    end = len(s)
    while end and (s[end - 1].isspace() or unicodedata.category(s[end - 1]).startswith("P")):
        end -= 1
    return s[:end]


def _parse(match: re.Match) -> float:
    value = float(match["digits"].replace(",", ""))
    return -value if match["sign"] else value


def extract_number(text: str) -> float | None:
    """The final numeric answer in ``text``, or None if it has no number.

    An explicit marker wins ("The answer is 42", "#### 1,234"): the first
    number after the last marker is taken, since working shown after the
    answer may contain other numbers. Without a marker, or with nothing
    numeric after it, the last number in the text is the answer.
    """
    markers = list(_MARKER.finditer(text))
    if markers:
        after = _NUMBER.search(text, markers[-1].end())
        if after:
            return _parse(after)
    numbers = list(_NUMBER.finditer(text))
    return _parse(numbers[-1]) if numbers else None


def is_correct(
    prediction: str,
    reference: str | float,
    kind: Literal["label", "number"] = "label",
) -> bool:
    """Whether ``prediction`` answers ``reference``.

    ``"label"`` compares normalized labels exactly. ``"number"`` extracts the
    numbers from both (a numeric reference is used as is) and accepts a
    relative difference up to 1e-4, which forgives float formatting and
    rounding in the last digits ("12.00" for 12, "0.33333" for 1/3) but not a
    coarse approximation ("0.33" for 1/3).
    A reference without a number is a data error, so it raises.
    """
    if kind == "label":
        return normalize_label(prediction) == normalize_label(str(reference))
    if kind == "number":
        ref = extract_number(reference) if isinstance(reference, str) else float(reference)
        if ref is None:
            raise ValueError(f"reference {reference!r} contains no number")
        pred = extract_number(prediction)
        return pred is not None and math.isclose(pred, ref, rel_tol=REL_TOL)
    raise ValueError(f"kind must be 'label' or 'number', got {kind!r}")
