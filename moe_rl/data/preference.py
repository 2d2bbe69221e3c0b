"""Preference pairs for DPO: JSONL / parquet files and toy preference tasks.

A row gives a prompt and two responses, the preferred (`chosen`) and the other
(`rejected`), in one of three forms:

- text: `prompt`, `chosen`, `rejected` strings. The prompt is encoded as the prompt
  datasets encode plain text (the tokenizer's special tokens added); each response is
  encoded without special tokens and ends with the tokenizer's EOS token, so the
  policy learns where a preferred answer stops.
- chat: `prompt` a list of {"role", "content"} messages, `chosen` and `rejected` lists
  of the messages that answer it (usually one assistant message). The prompt is
  rendered with the tokenizer's chat template and a generation prompt, as the prompt
  datasets do; a response is the rest of the rendered conversation prompt + response.
- ids: `prompt_ids`, `chosen_ids`, `rejected_ids` lists of token ids, used as they are
  (no tokenizer needed, nothing appended).

Bad rows fail with `file:line: what is wrong` (`DataError`, up to 10 rows at once).
Pairs longer than `max_len` tokens (prompt + the longer response) are skipped and
counted, not truncated.

Toy preference tasks, `toy:pref-<task>` and `toy:pref-<task>-eval` for every toy
prompt task (`moe_rl.data.toy`, e.g. `toy:pref-add-medium`): for each problem
`<bos> a + b =` the chosen response is the right answer then `<eos>`, the rejected one
a wrong number then `<eos>`. The wrong numbers of each problem (0..9, or up to the
task's largest answer) are split in a seeded order: two thirds make the training
pairs, the other third the `-eval` pairs, so evaluation scores pairs never trained
on (the problems themselves are shared, as for the toy prompt tasks).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from moe_rl.data.dataset import (TOY_PREFIX, DataError, TokenizerLike, _check_ids, _check_messages, _encode,
                                 _jsonl_rows, _kind, _parquet_rows, _render_chat, _RowError, _uid, parse_rows)
from moe_rl.data.sampler import seeded_shuffle
from moe_rl.data.toy import ToyTokenizer, make_toy_examples

__all__ = ["PREF_PREFIX", "PreferenceDataset", "PreferencePair", "load_preference_dataset", "toy_preference_pairs"]

log = logging.getLogger(__name__)

PREF_PREFIX = "pref-"  # toy:pref-<task>: preference pairs built from the toy prompt task <task>
EVAL_SHARE = 3  # every third wrong answer of a toy problem is held out for evaluation


@dataclass(frozen=True)
class PreferencePair:
    """One preference pair: prompt ids and the two responses' ids (without the prompt)."""

    uid: str
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt + chosen `[P + C]`, prompt + rejected `[P + R]`) as token tensors."""
        return (torch.tensor(self.prompt_ids + self.chosen_ids), torch.tensor(self.prompt_ids + self.rejected_ids))

    def __len__(self) -> int:
        """Tokens of both sequences together (what the pair costs in a packed row)."""
        return 2 * len(self.prompt_ids) + len(self.chosen_ids) + len(self.rejected_ids)


class PreferenceDataset(Sequence[PreferencePair]):
    """Loaded pairs, indexable; `tokenizer` is the one that encoded them (None for id rows)."""

    def __init__(self, pairs: list[PreferencePair], source: str, tokenizer: TokenizerLike | None,
                 num_skipped: int = 0) -> None:
        self.pairs, self.source, self.tokenizer, self.num_skipped = pairs, source, tokenizer, num_skipped

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> PreferencePair:  # type: ignore[override]
        return self.pairs[i]

    def __iter__(self) -> Iterator[PreferencePair]:
        return iter(self.pairs)

    def __repr__(self) -> str:
        return f"PreferenceDataset({self.source!r}, {len(self)} pairs, {self.num_skipped} skipped)"


def load_preference_dataset(spec: str, tokenizer: TokenizerLike | None = None,
                            max_len: int | None = None) -> PreferenceDataset:
    """Load `spec`: a `.jsonl` / `.parquet` file of pairs, or `toy:pref-<task>[-eval]`.

    Toy tasks bring their own `ToyTokenizer` (read it back from `dataset.tokenizer`).
    """
    if spec.startswith(TOY_PREFIX):
        pairs = toy_preference_pairs(spec[len(TOY_PREFIX):])
        return _drop_long(pairs, spec, ToyTokenizer(), max_len)
    path = Path(spec)
    if path.suffix not in (".jsonl", ".parquet"):
        raise DataError(f"{spec}: unsupported preference data; use a .jsonl or .parquet file or toy:pref-<task>")
    if not path.is_file():
        raise DataError(f"{spec}: no such file")
    rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path)
    pairs = parse_rows(rows, spec, lambda row, line_no: _pair(row, line_no, spec, tokenizer))
    return _drop_long(pairs, spec, tokenizer, max_len)


# --------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------

def _pair(row: dict[str, Any], line_no: int, source: str, tokenizer: TokenizerLike | None) -> PreferencePair:
    if any(row.get(k) is not None for k in ("prompt_ids", "chosen_ids", "rejected_ids")):
        prompt, chosen, rejected = (_ids_field(row, k) for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
    else:
        missing = [k for k in ("prompt", "chosen", "rejected") if row.get(k) is None]
        if missing:
            present = sorted(k for k, v in row.items() if v is not None)
            raise _RowError(f"missing {', '.join(map(repr, missing))}: a pair needs prompt + chosen + rejected "
                            f"(text or chat lists) or prompt_ids + chosen_ids + rejected_ids; "
                            f"fields present: {', '.join(present) or 'none'}")
        if isinstance(row["prompt"], list):
            prompt, chosen, rejected = _chat_pair(row, tokenizer)
        else:
            prompt, chosen, rejected = _text_pair(row, tokenizer)
    if chosen == rejected:
        raise _RowError("'chosen' and 'rejected' are the same response: the pair prefers nothing")
    return PreferencePair(_uid(row, line_no, source), prompt, chosen, rejected)


def _ids_field(row: dict[str, Any], key: str) -> list[int]:
    if row.get(key) is None:
        raise _RowError(f"'{key}' is missing: id rows need prompt_ids, chosen_ids and rejected_ids")
    try:
        return _check_ids(row[key])
    except _RowError as e:  # _check_ids names 'input_ids', the prompt datasets' field
        raise _RowError(str(e).replace("'input_ids'", f"'{key}'")) from None


def _text_pair(row: dict[str, Any], tokenizer: TokenizerLike | None) -> tuple[list[int], list[int], list[int]]:
    for key in ("prompt", "chosen", "rejected"):
        if not isinstance(row[key], str) or not row[key].strip():
            raise _RowError(f"'{key}' must be a non-empty string when 'prompt' is text, got {_kind(row[key])}")
    prompt = _encode(tokenizer, row["prompt"], "prompt", add_special_tokens=True)
    eos = getattr(tokenizer, "eos_token_id", None)
    end = [int(eos)] if eos is not None else []
    return (prompt, _encode(tokenizer, row["chosen"], "chosen", add_special_tokens=False) + end,
            _encode(tokenizer, row["rejected"], "rejected", add_special_tokens=False) + end)


def _chat_pair(row: dict[str, Any], tokenizer: TokenizerLike | None) -> tuple[list[int], list[int], list[int]]:
    prompt = _check_messages(row["prompt"], "prompt")
    prompt_text = _render_chat(tokenizer, prompt, "prompt")
    responses = []
    for key in ("chosen", "rejected"):
        if not isinstance(row[key], list):
            raise _RowError(f"'{key}' must be a list of messages when 'prompt' is one, got {_kind(row[key])}")
        full = _render_full(tokenizer, prompt + _check_messages(row[key], key), key)
        if not full.startswith(prompt_text):
            raise _RowError(f"the chat template renders prompt + '{key}' without the rendered prompt as its "
                            "start; give id rows (prompt_ids, chosen_ids, rejected_ids) for this template")
        responses.append(_encode(tokenizer, full[len(prompt_text):], key, add_special_tokens=False))
    return _encode(tokenizer, prompt_text, "prompt", add_special_tokens=False), responses[0], responses[1]


def _render_full(tokenizer: Any, messages: list[dict[str, str]], key: str) -> str:
    """A whole conversation rendered by the chat template (no generation prompt after it)."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    except Exception as e:  # templates raise arbitrary errors (e.g. jinja's for a wrong role order)
        raise _RowError(f"chat template failed on prompt + '{key}': {type(e).__name__}: {e}") from e


def _drop_long(pairs: list[PreferencePair], source: str, tokenizer: TokenizerLike | None,
               max_len: int | None) -> PreferenceDataset:
    """Keep pairs whose longer sequence has at most `max_len` tokens; log how many were dropped."""
    if max_len is None:
        return PreferenceDataset(pairs, source, tokenizer)
    longest = lambda p: len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))  # noqa: E731
    kept = [p for p in pairs if longest(p) <= max_len]
    if len(kept) < len(pairs):
        log.warning("%s: skipped %d of %d pairs longer than %d tokens", source, len(pairs) - len(kept), len(pairs),
                    max_len)
    if not kept:
        raise DataError(f"{source}: all {len(pairs)} pairs are longer than {max_len} tokens; raise dpo.max_len")
    return PreferenceDataset(kept, source, tokenizer, num_skipped=len(pairs) - len(kept))


# --------------------------------------------------------------------------
# Toy preference tasks
# --------------------------------------------------------------------------

def toy_preference_pairs(name: str) -> list[PreferencePair]:
    """Pairs of `pref-<task>` (two thirds of each problem's wrong answers) or `pref-<task>-eval` (the rest)."""
    if not name.startswith(PREF_PREFIX):
        raise DataError(f"{TOY_PREFIX}{name}: not a preference task; use {TOY_PREFIX}{PREF_PREFIX}<task>, "
                        f"e.g. {TOY_PREFIX}{PREF_PREFIX}add-medium (and -eval for the held-out pairs)")
    task = name[len(PREF_PREFIX):]
    held_out = task.endswith("-eval")
    task = task.removesuffix("-eval")
    try:
        examples = make_toy_examples(task)
    except KeyError as e:
        raise DataError(f"{TOY_PREFIX}{name}: {e.args[0]}") from None
    tok = ToyTokenizer()
    top = max(9, *(int(ex.answer) for ex in examples))
    pairs = []
    for i, ex in enumerate(examples):
        wrong = seeded_shuffle([n for n in range(top + 1) if str(n) != ex.answer], f"moe_rl.pref:{task}:{i}")
        mine = [w for j, w in enumerate(wrong) if (j % EVAL_SHARE == EVAL_SHARE - 1) == held_out]
        prompt = tok.encode(ex.prompt_text, add_special_tokens=True)
        answer = tok.encode(ex.answer) + [tok.eos_token_id]
        pairs += [PreferencePair(f"{name}:{i}:{w}", prompt, answer, tok.encode(str(w)) + [tok.eos_token_id])
                  for w in mine]
    return seeded_shuffle(pairs, f"moe_rl.pref:{name}")
