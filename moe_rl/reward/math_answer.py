"""Math answer checking without a CAS: exact comparison of final answers.

The completion's final answer is the content of its last `\\boxed{...}`
(nested braces allowed), or, when nothing is boxed, the last number in the
text (`1,234`, `-3.5`, `3/4`, `\\frac{1}{2}`). The reference answer may be a
bare answer, a `\\boxed{...}`, or a GSM8K-style solution ending in `#### 42`.

Both sides are normalised (LaTeX spacing, `\\left`/`\\right`, `\\dfrac` and
`\\tfrac`, `\\text{...}` wrappers and trailing unit words, degrees, percent
signs, `$`, thousands separators, a trailing period) and then compared:

- as numbers when both parse (integers, decimals, `a/b`, `\\frac{a}{b}`,
  `\\frac12`), exactly, with `fractions.Fraction`: 0.5 == 1/2 == \\frac{2}{4},
  3.0 == 3, but 0.333 != 1/3;
- otherwise as normalised strings, so `\\frac{\\sqrt{2}}{2}` or `(1, 2)` match
  themselves written with other spacing or `\\dfrac`.
An answer written as `x = 5` is compared by its right-hand side.

Percent signs are dropped, so 50\\% matches 50 (not 0.5), the common
convention of math answer keys.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import TYPE_CHECKING

from moe_rl.reward.registry import register_reward

if TYPE_CHECKING:
    from moe_rl.data.dataset import Prompt

__all__ = ["answers_match", "extract_final_answer", "last_boxed", "math_verify", "parse_number",
           "reference_answer"]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")

# The last number of free text. A '-' counts as a sign only when it does not follow
# a term (so "3-5" ends in 5, not -5); thousands groups must have exactly 3 digits.
_TEXT_NUMBER = re.compile(r"""
    (?:(?<![\w)\]}])-)?
    (?: \\[dt]?frac\{[^{}]*\}\{[^{}]*\}
      | (?<![\w.]) (?:\d{1,3}(?:,\d{3})+(?!\d) | \d+) (?:\.\d+)? (?:/\d+(?:\.\d+)?)?
      | (?<![\w.]) \.\d+ )
""", re.VERBOSE)

_DECIMAL = re.compile(r"(?:\d+\.?\d*|\.\d+)")
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SLASH_FRACTION = re.compile(r"(\d+\.?\d*|\.\d+)/(\d+\.?\d*|\.\d+)")
_TRAILING_UNIT = re.compile(r"(?<=[\d}])\s*\\(?:text|mbox|mathrm)\{[a-zA-Z\s]+\}\s*$")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox|mathbf)\{([^{}]*)\}")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?")
# Spacing and sizing commands that never change a value.
_NOISE = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "~", "\\$", "$",
          "\\%", "%")


@register_reward("math", reads_ids=False)
def math_verify(completion_text: str, answer: str | None, *, prompt: Prompt | None = None,
                completion_ids: list[int] | None = None, **metadata: object) -> float:
    """1.0 when the completion's final answer equals `answer`, else 0.0.

    Raises ValueError when there is no reference answer: a math dataset
    without answers is a data bug, which `RewardRunner` counts and reports.
    """
    if answer is None:
        raise ValueError("math reward needs a reference answer (data.answer_key), and this prompt has none")
    candidate = extract_final_answer(completion_text)
    if candidate is None:
        return 0.0
    return 1.0 if answers_match(candidate, reference_answer(answer)) else 0.0


def extract_final_answer(text: str) -> str | None:
    """The last `\\boxed{...}` content, else the last number in `text`, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _TEXT_NUMBER.findall(text.replace("\u2212", "-"))  # U+2212 is the typeset minus
    return numbers[-1] if numbers else None


def reference_answer(answer: str) -> str:
    """The answer part of a reference: after the last `####`, inside `\\boxed{}`, or all of it."""
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip()
    boxed = last_boxed(answer)
    return boxed if boxed is not None else answer


def last_boxed(text: str) -> str | None:
    """Content of the last balanced `\\boxed{...}` (or `\\fbox{...}`) in `text`."""
    for m in reversed(list(_BOXED.finditer(text))):
        content = _braced(text, m.end())
        if content is not None:
            return content
    return None


def _braced(text: str, start: int, pair: str = "{}") -> str | None:
    """Text from `start` up to the bracket closing an already-opened `pair[0]`; None if unclosed."""
    depth, i = 1, start
    while i < len(text):
        c = text[i]
        if c == "\\":  # an escaped brace such as \{ does not open or close anything
            i += 2
            continue
        depth += (c == pair[0]) - (c == pair[1])
        if depth == 0:
            return text[start:i]
        i += 1
    return None


def answers_match(candidate: str, reference: str) -> bool:
    """Whether two answer strings denote the same answer (numbers exactly, else normalised text)."""
    for cand, ref in ((candidate, reference), (_rhs(candidate), _rhs(reference))):
        a, b = parse_number(cand), parse_number(ref)
        if a is not None and b is not None:
            return a == b
        if a is None and b is None:
            na, nb = normalize(cand), normalize(ref)
            if na and na == nb:
                return True
    return False


def _rhs(answer: str) -> str:
    """The right-hand side of `x = 5`; the answer itself when it has no '='."""
    return answer.rsplit("=", 1)[1] if "=" in answer else answer


def normalize(answer: str) -> str:
    """A canonical spelling of an answer: value-neutral LaTeX and formatting removed."""
    s = answer.replace("\u2212", "-")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = s.replace("{,}", ",")  # LaTeX's thousands separator 1{,}000
    s = _TRAILING_UNIT.sub("", s)  # "5\text{ cm}" is 5
    s = _DEGREES.sub("", s)
    for noise in _NOISE:
        s = s.replace(noise, "")
    s = _TEXT_WRAPPER.sub(r"\1", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    return _unwrap(s)


def _unwrap(s: str) -> str:
    """Drop braces around the whole answer, and parentheses unless they hold a tuple or interval."""
    while len(s) >= 2 and (s[0], s[-1]) in (("{", "}"), ("(", ")")):
        inner = s[1:-1]
        if _braced(s, 1, s[0] + s[-1]) != inner or (s[0] == "(" and "," in inner):
            break  # "{a}{b}" is not one group; "(1,2)" is a pair, not the number 12
        s = inner
    return s


def parse_number(answer: str) -> Fraction | None:
    """The exact value of a numeric answer, or None when it is not a plain number."""
    s = normalize(answer)
    sign = 1
    while s[:1] in ("-", "+"):
        sign, s = (-sign if s[0] == "-" else sign), _unwrap(s[1:])
    value = _unsigned_number(s)
    return None if value is None else sign * value


def _unsigned_number(s: str) -> Fraction | None:
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if _DECIMAL.fullmatch(s):
        return Fraction(s.rstrip(".") or "0")
    m = _SLASH_FRACTION.fullmatch(s)
    if m:
        return _ratio(Fraction(m.group(1)), Fraction(m.group(2)))
    if s.startswith("\\frac"):
        return _latex_fraction(s[len("\\frac"):])
    return None


def _latex_fraction(rest: str) -> Fraction | None:
    """Value of `{a}{b}` or `ab` (as in \\frac12) after `\\frac`, when both parts are numbers."""
    parts = []
    for _ in range(2):
        if rest.startswith("{"):
            inner = _braced(rest, 1)
            if inner is None:
                return None
            parts.append(inner)
            rest = rest[len(inner) + 2:]
        elif rest:
            parts.append(rest[0])
            rest = rest[1:]
        else:
            return None
    if rest:
        return None  # something follows the fraction, e.g. \frac{1}{2}x
    num, den = parse_number(parts[0]), parse_number(parts[1])
    return None if num is None or den is None else _ratio(num, den)


def _ratio(num: Fraction, den: Fraction) -> Fraction | None:
    return None if den == 0 else num / den
