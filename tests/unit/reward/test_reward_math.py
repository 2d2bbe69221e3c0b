"""The math answer checker on a table of completions and reference answers."""
from __future__ import annotations

from fractions import Fraction

import pytest

from moe_rl.reward import extract_final_answer, math_verify, parse_number

CASES = [
    # (completion, reference answer, expected reward)
    (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
    ("The answer is 1,234.", "1234", 1.0),
    (r"\boxed{1,234}", "1234", 1.0),
    (r"\boxed{1{,}000}", "1000", 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}", 1.0),  # nested braces, compared as text
    (r"\boxed{\dfrac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}", 1.0),
    (r"\boxed{-3}", "-3", 1.0),
    ("so x = -5", "-5", 1.0),
    ("no number at all", "3", 0.0),
    ("", "3", 0.0),
    (r"\boxed{3}", "4", 0.0),
    (r"\boxed{2} then, correcting, \boxed{7}", "7", 1.0),  # the last box counts
    (r"\boxed{7}, checked with 2 other ways", "7", 1.0),  # a box beats a later bare number
    ("3.0", "3", 1.0),
    (r"\boxed{10}", "10.00", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
    (r"\boxed{\left( 3 \right)}", "3", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    ("about 50% of them", "50", 1.0),
    (r"\boxed{0.333}", "1/3", 0.0),  # exact comparison: no tolerance
    (r"\boxed{\frac12}", "0.5", 1.0),
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    (r"\boxed{\frac{-1}{2}}", "-1/2", 1.0),
    (r"\boxed{1/2}", r"\frac{2}{4}", 1.0),
    ("0.5", r"\frac{1}{2}", 1.0),
    (r"the answer is $\frac{3}{4}$.", "0.75", 1.0),
    ("5 - 3 = 2", "2", 1.0),
    ("between 3-5", "-5", 0.0),  # a binary minus is not a sign
    ("\u22127", "-7", 1.0),  # typeset minus sign
    (r"\boxed{x = 12}", "12", 1.0),
    (r"\boxed{5\text{ cm}}", "5", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{(1, 2)}", "(1,2)", 1.0),
    (r"\boxed{[1, 2]}", "(1,2)", 0.0),  # closed vs open interval
    (r"\boxed{(1,200)}", "1200", 0.0),  # a pair, not a thousands separator
    (r"\boxed{\text{(A)}}", "A", 1.0),
    (r"\boxed{}", "0", 0.0),
    (r"\boxed{\frac{1}{0}}", "0", 0.0),
    (r"\boxed{\frac{1}{2}", "0.5", 1.0),  # unclosed box: the last number in the text counts
    (r"\boxed{3", "2", 0.0),
    ("The answer is 42", "Natalia sold 48/2 = 24 clips... #### 42", 1.0),  # GSM8K reference
    (r"\boxed{12}", r"\boxed{12}", 1.0),
    (r"\boxed{12}", "1.2", 0.0),
    ("It costs \\$18.", "18", 1.0),
    (r"\boxed{-0}", "0", 1.0),
    (r"\boxed{\{1, 2\}}", r"\{1,2\}", 1.0),  # escaped braces inside a box
]


@pytest.mark.parametrize("completion,answer,expected", CASES)
def test_math_verify_table(completion, answer, expected):
    assert math_verify(completion, answer) == expected


def test_math_verify_needs_a_reference():
    with pytest.raises(ValueError, match="reference answer"):
        math_verify(r"\boxed{1}", None)


@pytest.mark.parametrize("text,value", [
    ("42", Fraction(42)), ("-3.25", Fraction(-13, 4)), (r"\frac{6}{4}", Fraction(3, 2)),
    ("1,000,000", Fraction(10**6)), ("+7", Fraction(7)), (".5", Fraction(1, 2)),
    ("x^2", None), ("1,2", None), (r"\frac{1}{2}x", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_extract_final_answer_nested_box():
    assert extract_final_answer(r"a \boxed{\frac{a^{2}}{b_{1}}} b") == r"\frac{a^{2}}{b_{1}}"
    assert extract_final_answer("nothing here") is None
