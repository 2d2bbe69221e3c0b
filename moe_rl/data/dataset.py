"""Prompt datasets: JSONL / parquet files and built-in toy tasks, tokenised once at load.

A row (a JSON object per line, or a parquet row) gives its prompt in one of
three forms, tried in this order:

- `row[prompt_key]` a string: used verbatim (no chat template), as in
  "zero" RL on base models; the tokenizer adds its usual special tokens.
- `row[prompt_key]` or `row["messages"]` a chat list of {"role", "content"}:
  rendered with `tokenizer.apply_chat_template(..., add_generation_prompt=True)`.
  To train an instruct model with its chat format, store prompts this way.
- `row["input_ids"]` a list of token ids: used as is (works without a
  tokenizer, e.g. for a fresh model with no tokenizer files).

`row[answer_key]` (a string or a number; optional) is the reference answer
handed to the reward. Every other non-null field is kept in `Prompt.metadata`
and passed to the reward function as keyword arguments. `uid` is the row's
"uid" or "id" field when present, else `<file name>:<line>`.

Prompts longer than `max_prompt_len` tokens are skipped, not truncated
(truncation would change the task): the count is logged and kept in
`PromptDataset.num_skipped`. Malformed rows are errors: a `DataError` lists
each one (up to 10) as `file:line: what is wrong`, 1-based.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

from moe_rl.data.toy import ToyTokenizer, get_toy_task, make_toy_examples

__all__ = ["DataError", "Prompt", "PromptDataset", "TokenizerLike", "load_dataset"]

log = logging.getLogger(__name__)

TOY_PREFIX = "toy:"
MAX_REPORTED_PROBLEMS = 10  # enough to show a pattern without flooding the terminal


class DataError(ValueError):
    """A dataset that cannot be loaded; `problems` holds one `file:line: ...` line per bad row, and
    `more` says that reading stopped at a bad row past those (so the count is a lower bound)."""

    def __init__(self, problems: str | Sequence[str], more: bool = False):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.more = more
        if len(self.problems) == 1 and not more:
            message = self.problems[0]
        else:
            head = (f"more than {len(self.problems)} bad rows (reading stopped; the first {len(self.problems)}):"
                    if more else f"{len(self.problems)} bad rows:")
            message = head + "\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


class TokenizerLike(Protocol):
    """What the data code needs of a tokenizer (HF tokenizers and `ToyTokenizer` qualify)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class Prompt:
    """One prompt, ready for the rollout engine.

    uid: stable identifier (row's uid/id, `<file>:<line>`, or `<task>:<index>`).
    prompt_ids: token ids sent to the engine.
    prompt_text: the text those ids encode ("" for id-only rows without a tokenizer).
    answer: reference answer for the reward, or None.
    metadata: the row's other fields.
    """

    uid: str
    prompt_ids: list[int]
    prompt_text: str
    answer: str | None
    metadata: dict[str, Any] = field(default_factory=dict)


class PromptDataset(Sequence[Prompt]):
    """Loaded prompts, indexable; `tokenizer` is the one that encoded them."""

    def __init__(self, prompts: list[Prompt], source: str, tokenizer: TokenizerLike | None,
                 num_skipped: int = 0):
        self.prompts = prompts
        self.source = source
        self.tokenizer = tokenizer
        self.num_skipped = num_skipped

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:  # type: ignore[override]
        return self.prompts[i]

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self.prompts)

    def __repr__(self) -> str:
        return f"PromptDataset({self.source!r}, {len(self)} prompts, {self.num_skipped} skipped)"


def load_dataset(spec: str, tokenizer: TokenizerLike | None = None, prompt_key: str = "prompt",
                 answer_key: str = "answer", max_prompt_len: int | None = None) -> PromptDataset:
    """Load `spec`: a `.jsonl` / `.parquet` file, or `toy:<task>`.

    Toy tasks bring their own `ToyTokenizer` (the `tokenizer` argument is not
    used for them); read it back from `dataset.tokenizer`.
    """
    if spec.startswith(TOY_PREFIX):
        return load_toy_dataset(spec[len(TOY_PREFIX):], max_prompt_len)
    path = Path(spec)
    if path.suffix not in (".jsonl", ".parquet"):
        raise DataError(f"{spec}: unsupported dataset; use a .jsonl or .parquet file or toy:<task>")
    if not path.is_file():
        raise DataError(f"{spec}: no such file")
    rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path)
    return _build(rows, spec, tokenizer, prompt_key, answer_key, max_prompt_len)


def load_toy_dataset(task: str, max_prompt_len: int | None = None) -> PromptDataset:
    """The toy task `task` (e.g. "add-easy") as a dataset encoded with `ToyTokenizer`."""
    try:
        get_toy_task(task)
    except KeyError as e:
        raise DataError(f"{TOY_PREFIX}{task}: {e.args[0]}") from None
    tok = ToyTokenizer()
    prompts = [
        Prompt(uid=f"{task}:{i}", prompt_ids=tok.encode(ex.prompt_text, add_special_tokens=True),
               prompt_text=ex.prompt_text, answer=ex.answer, metadata={"task": task, **ex.metadata})
        for i, ex in enumerate(make_toy_examples(task))
    ]
    return _drop_long(prompts, f"{TOY_PREFIX}{task}", tok, max_prompt_len)


# --------------------------------------------------------------------------
# Reading rows: (line number, row dict or a problem string)
# --------------------------------------------------------------------------

def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """Rows of a JSONL file; blank lines are skipped, undecodable lines yield a problem."""
    with open(path, "rb") as f:  # bytes, so a bad UTF-8 sequence is reported with its line
        for line_no, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield line_no, f"not valid UTF-8 ({e.reason} at byte {e.start})"
                continue
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                yield line_no, f"invalid JSON ({e.msg} at column {e.colno})"
                continue
            yield line_no, row if isinstance(row, dict) else f"expected a JSON object, got {_kind(row)}"


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """Rows of a parquet file, numbered from 1 like lines."""
    import pyarrow.parquet as pq  # only parquet users pay for the import

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a corrupt or foreign file
        raise DataError(f"{path}: cannot read as parquet ({type(e).__name__}: {e})") from e
    for row_no, row in enumerate(table.to_pylist(), start=1):
        yield row_no, row


# --------------------------------------------------------------------------
# Turning rows into prompts
# --------------------------------------------------------------------------

def _build(rows: Iterable[tuple[int, dict[str, Any] | str]], source: str,
           tokenizer: TokenizerLike | None, prompt_key: str, answer_key: str,
           max_prompt_len: int | None) -> PromptDataset:
    prompts = parse_rows(rows, source, lambda row, line_no: _prompt(row, line_no, source, tokenizer,
                                                                    prompt_key, answer_key))
    return _drop_long(prompts, source, tokenizer, max_prompt_len)


def parse_rows(rows: Iterable[tuple[int, dict[str, Any] | str]], source: str,
               make: Callable[[dict[str, Any], int], Any]) -> list[Any]:
    """`make(row, line_no)` of every row; a `DataError` lists the bad rows as `file:line: ...`.

    `make` raises `_RowError` for a bad row; an empty file is an error too.
    """
    where = _locator(source)
    items, problems, more = [], [], False
    for line_no, row in rows:
        try:
            if isinstance(row, str):
                raise _RowError(row)
            items.append(make(row, line_no))
        except _RowError as e:
            if len(problems) == MAX_REPORTED_PROBLEMS:  # one bad row past the report: stop reading
                more = True
                break
            problems.append(f"{where(line_no)}: {e}")
    if problems:
        raise DataError(problems, more)
    if not items:
        raise DataError(f"{source}: the file has no rows")
    return items


class _RowError(Exception):
    """What is wrong with one row; `_build` prefixes the file and line."""


def _locator(source: str) -> Callable[[int], str]:
    """`file:line` for JSONL, `file: row N` for parquet (it has no lines)."""
    if source.endswith(".parquet"):
        return lambda n: f"{source}: row {n}"
    return lambda n: f"{source}:{n}"


def _prompt(row: dict[str, Any], line_no: int, source: str, tokenizer: TokenizerLike | None,
            prompt_key: str, answer_key: str) -> Prompt:
    used_key, ids, text = _prompt_ids(row, tokenizer, prompt_key)
    # Null fields are dropped: parquet fills every column a row lacks with null.
    metadata = {k: v for k, v in row.items() if k not in (used_key, answer_key) and v is not None}
    return Prompt(uid=_uid(row, line_no, source), prompt_ids=ids, prompt_text=text,
                  answer=_answer(row, answer_key), metadata=metadata)


def _prompt_ids(row: dict[str, Any], tokenizer: TokenizerLike | None,
                prompt_key: str) -> tuple[str, list[int], str]:
    """(field used, prompt ids, prompt text) from the first prompt form present in `row`."""
    for key in (prompt_key, "messages", "input_ids"):
        value = row.get(key)
        if value is None:
            continue
        if key == "input_ids":
            ids = _check_ids(value)
            return key, ids, _safe_decode(tokenizer, ids)
        if isinstance(value, str) and key == prompt_key:
            if not value.strip():
                raise _RowError(f"'{key}' is an empty string")
            return key, _encode(tokenizer, value, key, add_special_tokens=True), value
        if isinstance(value, list):
            text = _render_chat(tokenizer, _check_messages(value, key), key)
            return key, _encode(tokenizer, text, key, add_special_tokens=False), text
        allowed = "a string or a list" if key == prompt_key else "a list"
        raise _RowError(f"'{key}' must be {allowed} of {{role, content}} messages, got {_kind(value)}")
    present = sorted(k for k, v in row.items() if v is not None)
    raise _RowError(f"no prompt: expected a '{prompt_key}', 'messages' or 'input_ids' field; "
                    f"fields present: {', '.join(present) or 'none'}")


def _check_ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not value:
        raise _RowError(f"'input_ids' must be a non-empty list of token ids, got {_kind(value)}")
    bad = next((v for v in value if not isinstance(v, int) or isinstance(v, bool) or v < 0), None)
    if bad is not None:
        raise _RowError(f"'input_ids' must hold non-negative integers; found {bad!r}")
    return list(value)


def _check_messages(value: list, key: str) -> list[dict[str, str]]:
    if not value:
        raise _RowError(f"'{key}' is an empty message list")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) \
                or not isinstance(msg.get("content"), str):
            raise _RowError(f"'{key}'[{i}] must be an object with string 'role' and 'content', "
                            f"got {_kind(msg)} {_short(msg)}")
    return value


def _render_chat(tokenizer: TokenizerLike | None, messages: list[dict[str, str]], key: str) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise _RowError(f"'{key}' is a chat message list, which needs a tokenizer with a chat "
                        "template; give plain-text prompts or input_ids instead")
    try:
        render = tokenizer.apply_chat_template  # type: ignore[attr-defined]
        return render(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # templates raise arbitrary errors (e.g. jinja's for a wrong role order)
        raise _RowError(f"chat template failed on '{key}': {type(e).__name__}: {e}") from e


def _encode(tokenizer: TokenizerLike | None, text: str, key: str, *, add_special_tokens: bool) -> list[int]:
    # A chat template already writes the special tokens, so they are only added to plain text.
    if tokenizer is None:
        raise _RowError(f"'{key}' is text but no tokenizer was given (the model has no tokenizer "
                        "files); give input_ids rows or use a toy:<task>")
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except Exception as e:
        raise _RowError(f"cannot tokenise '{key}': {type(e).__name__}: {e}") from e
    if not ids:
        raise _RowError(f"'{key}' tokenises to no tokens")
    return ids


def _safe_decode(tokenizer: TokenizerLike | None, ids: list[int]) -> str:
    """The text of id-only rows, for logs and rewards; "" when it cannot be known."""
    if tokenizer is None:
        return ""
    try:
        return tokenizer.decode(ids)
    except Exception as e:
        raise _RowError(f"'input_ids' do not decode with this tokenizer: {type(e).__name__}: {e}") from e


def _answer(row: dict[str, Any], answer_key: str) -> str | None:
    value = row.get(answer_key)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # numeric answers are common in math sets; the checker parses text
    raise _RowError(f"'{answer_key}' must be a string or a number, got {_kind(value)} {_short(value)}")


def _uid(row: dict[str, Any], line_no: int, source: str) -> str:
    for key in ("uid", "id"):
        if isinstance(row.get(key), (str, int)) and not isinstance(row.get(key), bool):
            return str(row[key])
    return f"{Path(source).name}:{line_no}"


def _drop_long(prompts: list[Prompt], source: str, tokenizer: TokenizerLike | None,
               max_prompt_len: int | None) -> PromptDataset:
    """Keep prompts of at most `max_prompt_len` tokens; log how many were dropped."""
    if max_prompt_len is None:
        return PromptDataset(prompts, source, tokenizer)
    kept = [p for p in prompts if len(p.prompt_ids) <= max_prompt_len]
    skipped = len(prompts) - len(kept)
    if skipped:
        longest = max(len(p.prompt_ids) for p in prompts)
        log.warning("%s: skipped %d of %d prompts longer than max_prompt_len=%d tokens (longest: %d)",
                    source, skipped, len(prompts), max_prompt_len, longest)
    if not kept:
        raise DataError(f"{source}: all {len(prompts)} prompts are longer than "
                        f"max_prompt_len={max_prompt_len} tokens; raise data.max_prompt_len")
    return PromptDataset(kept, source, tokenizer, num_skipped=skipped)


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
