from decimal import Decimal

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from milo_infer.tasks.scoring import extract_number, is_correct, normalize_label


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("Card_Lost", "card lost"),
        ("  card   lost.\n", "card lost"),
        ("top_up!?", "top up"),
        ("exchange rate ... ", "exchange rate"),
        ("card_arrival_", "card arrival"),
        ("e.g. card", "e.g. card"),  # only trailing punctuation goes
        ("", ""),
    ],
)
def test_normalize_label(raw, expected):
    assert normalize_label(raw) == expected


@given(st.text())
def test_normalize_label_is_idempotent(s):
    assert normalize_label(normalize_label(s)) == normalize_label(s)


@given(st.lists(st.text("abcdefghij", min_size=1), min_size=1, max_size=4))
def test_surface_variants_of_a_label_agree(words):
    label = " ".join(words)
    variant = "  " + "_".join(words).upper() + ".\n"
    assert normalize_label(variant) == normalize_label(label) == label


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 42.", 42.0),
        ("#### 1,234", 1234.0),
        ("-3.5", -3.5),
        ("$12", 12.0),
        ("It costs -$12 in total", -12.0),
        ("So 3 + 4 = 7", 7.0),
        ("then 3-4 more", 4.0),  # a hyphen between numbers is not a sign
        ("1, 2, 3", 3.0),
        ("about .5 of it", 0.5),
        ("The answer is 18 apples. Check: 6 * 3 = 18, plus 2", 18.0),
        ("6 * 3 = 18\n#### 18\nThe next question has 5", 18.0),
        ("The answer is unknown, but 7 is likely", 7.0),  # marker without a number
        ("v2.1 has 9 fixes", 9.0),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_number(text, expected):
    assert extract_number(text) == expected


@given(st.integers(-10**9, 10**9), st.integers(0, 10**6))
def test_formatted_integers_round_trip(n, noise):
    for text in (str(n), f"{n:,}", f"The answer is {n}.", f"step {noise}\n#### {n:,}"):
        assert extract_number(text) == n


@given(st.decimals(min_value=-10**6, max_value=10**6, places=3, allow_nan=False, allow_infinity=False))
def test_formatted_decimals_round_trip(d):
    assert extract_number(f"so the total is {d:f} dollars") == float(Decimal(f"{d:f}"))


@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6))
def test_marker_beats_later_numbers(answer, later):
    assert extract_number(f"The answer is {answer}. Check: {later}") == answer


def test_is_correct_labels():
    assert is_correct(" Card_lost.", "card lost")
    assert not is_correct("card", "card lost")
    assert is_correct("card lost", "card lost", kind="label")


def test_is_correct_numbers_use_relative_tolerance():
    assert is_correct("The answer is 12.00", "#### 12", kind="number")
    assert is_correct("0.33333", 1 / 3, kind="number")
    assert not is_correct("0.33", 1 / 3, kind="number")
    assert is_correct("100010", 100000, kind="number")  # 1e-4 relative
    assert not is_correct("100011", 100000, kind="number")
    assert not is_correct("I don't know", "7", kind="number")
    assert is_correct("0", 0, kind="number") and not is_correct("0.0001", 0, kind="number")


def test_is_correct_errors():
    with pytest.raises(ValueError, match="contains no number"):
        is_correct("7", "seven", kind="number")
    with pytest.raises(ValueError, match="kind"):
        is_correct("7", "7", kind="exact")


@given(st.floats(min_value=-1e9, max_value=1e9, allow_nan=False).filter(lambda x: abs(x) > 1e-9))
def test_a_number_printed_to_six_significant_figures_is_correct(x):
    # Positional, never scientific: models write "0.0000610", not "6.1e-05".
    printed = np.format_float_positional(x, precision=6, fractional=False, trim="-")
    assert is_correct(f"#### {printed}", x, kind="number")
