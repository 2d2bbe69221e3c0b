"""Built-in toy tasks and their 16-token tokenizer, for the CPU demo and tests.

A freshly initialised tiny model has no tokenizer files, so the toy tasks bring
their own: one token per symbol, nothing learned, nothing downloaded.

    id  token       id  token
    0   <pad>       3-12  '0'-'9'
    1   <bos>       13  '+'
    2   <eos>       14  '-'   (reserved for tasks with negative numbers)
                    15  '='

A model trained on toy tasks needs `vocab_size >= 16` (16 exactly is enough).

Tasks (`toy:<name>` in `data.train` / `data.eval`); a prompt is
`<bos> a + b =` and the expected completion is the digits of a+b, then `<eos>`:

    name        operands   prompts  answers
    add-easy    0..2       9        0..4    (one digit)
    add-medium  0..4       25       0..8    (one digit)
    add-hard    0..9       100      0..18   (one or two digits)

and one task with many distinct prompts, where a prompt is `<bos> a b c =`:

    last-parity every abc   1,000    c mod 2 (one digit: 0 or 1)

and one whose answers have a long-tailed length, where a prompt is `<bos> a b =`:

    echo-tail   every ab    100      the digit a, ECHO_LENGTHS[b] times: 1, 1, 1, 2, 2, 3, 4,
                                     6, 12 or 32 tokens (mean 6.4; for asynchronous rollouts,
                                     where a batch waits for its longest answers)

Each `<name>-eval` variant holds the same problems in another seeded order.
The problem spaces are tiny, so there is nothing to hold out: evaluation
measures how well the policy solves these prompts, not generalisation.

Chance level (success rate of a policy that samples uniformly over all 16
tokens, as a fresh model nearly does; `chance_level()` computes it). A
completion counts when its tokens before the first `<eos>` (all of them when
generation stopped at `max_new_tokens`) spell the answer:

    task        max_new_tokens=1   max_new_tokens=2    max_new_tokens>=3
    add-easy    1/16   = 6.25 %    1/256 = 0.39 %      0.39 %
    add-medium  1/16   = 6.25 %    1/256 = 0.39 %      0.39 %
    add-hard    0.55/16 = 3.44 %   1/256 = 0.39 %      0.23 %
    last-parity 1/16   = 6.25 %    1/256 = 0.39 %      0.39 %
    echo-tail   3/160  = 1.88 %    ...                 (chance_level computes it)

With `max_new_tokens=1` the answer digit alone is judged (no `<eos>` needed),
which gives RL the densest signal on the one-digit tasks.

A policy that ignores the operands can still reach the share of the most
common answer: 3/9 on add-easy ("2"), 5/25 on add-medium ("4"), 10/100 on
add-hard ("9"), 1/2 on last-parity (always "0" or always "1"). A run that
plateaus there (often as a collapse to one answer when the learning rate is
too high) has not learned the task.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from moe_rl.data.sampler import seeded_shuffle

__all__ = [
    "TOY_TOKENS", "ToyExample", "ToyTask", "ToyTokenizer", "chance_level", "get_toy_task",
    "make_toy_examples", "register_toy_task", "save_toy_tokenizer", "toy_task_names",
]

# The vocabulary, in id order. Special tokens first so PAD=0, BOS=1, EOS=2.
TOY_TOKENS: tuple[str, ...] = (
    "<pad>", "<bos>", "<eos>", *"0123456789", "+", "-", "=",
)

# One special marker, one symbol, or a run of whitespace (which encodes to nothing).
_PIECE = re.compile(r"<pad>|<bos>|<eos>|\s+|.", re.DOTALL)


class ToyTokenizer:
    """Character-level tokenizer over `TOY_TOKENS` with the HF calls the data code uses.

    `encode` maps each symbol to one id and ignores whitespace; special tokens
    may be written as `<pad>`, `<bos>`, `<eos>`. `decode` joins tokens without
    spaces, so `decode(encode(s)) == s` for any `s` without whitespace.
    """

    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    chat_template: None = None  # no chat format: data code treats prompts as plain text

    def __init__(self) -> None:
        self._ids = {tok: i for i, tok in enumerate(TOY_TOKENS)}

    @property
    def vocab_size(self) -> int:
        return len(TOY_TOKENS)

    @property
    def all_special_ids(self) -> list[int]:
        return [self.pad_token_id, self.bos_token_id, self.eos_token_id]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of `text`; with `add_special_tokens` a BOS id is prepended (as HF tokenizers do).

        Raises ValueError naming the first symbol outside the vocabulary.
        """
        ids = [self.bos_token_id] if add_special_tokens else []
        for m in _PIECE.finditer(text):
            piece = m.group()
            if piece.isspace():
                continue
            if piece not in self._ids:
                raise ValueError(f"toy tokenizer: {piece!r} at position {m.start()} of {text!r} "
                                 f"is not in the vocabulary {''.join(TOY_TOKENS[3:])} + specials")
            ids.append(self._ids[piece])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; special tokens appear as `<pad>` etc. unless skipped."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(TOY_TOKENS):
                raise ValueError(f"toy tokenizer: id {i} is outside the vocabulary [0, {len(TOY_TOKENS)})")
            if skip_special_tokens and i in self.all_special_ids:
                continue
            out.append(TOY_TOKENS[i])
        return "".join(out)

    def __len__(self) -> int:
        return self.vocab_size


@dataclass(frozen=True)
class ToyExample:
    """One toy problem: `prompt_text` (without BOS), its `answer`, and the values behind it."""

    prompt_text: str
    answer: str
    metadata: dict[str, int]


@dataclass(frozen=True)
class ToyTask:
    """A registered task: `build(seed)` returns its examples in a seeded order."""

    name: str
    description: str
    build: Callable[[int], list[ToyExample]]
    seed: int


_TASKS: dict[str, ToyTask] = {}


def register_toy_task(name: str, description: str, build: Callable[[int], list[ToyExample]],
                      *, eval_seed: int = 1, seed: int = 0) -> None:
    """Register `name` (built with `seed`) and `name-eval` (the same builder with `eval_seed`)."""
    for task_name, task_seed in ((name, seed), (f"{name}-eval", eval_seed)):
        if task_name in _TASKS:
            raise ValueError(f"toy task {task_name!r} is already registered")
        _TASKS[task_name] = ToyTask(task_name, description, build, task_seed)


def toy_task_names() -> list[str]:
    """All registered task names, sorted."""
    return sorted(_TASKS)


def get_toy_task(name: str) -> ToyTask:
    """The task called `name`; a KeyError lists the known names."""
    if name not in _TASKS:
        raise KeyError(f"unknown toy task {name!r}; known tasks: {', '.join(toy_task_names())}")
    return _TASKS[name]


def make_toy_examples(name: str) -> list[ToyExample]:
    """The examples of task `name`, identical on every call and machine."""
    task = get_toy_task(name)
    return task.build(task.seed)


def _addition(max_operand: int) -> Callable[[int], list[ToyExample]]:
    """Builder of every `a+b=` with a, b in 0..max_operand, in a seeded order."""
    def build(seed: int) -> list[ToyExample]:
        pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
        return [ToyExample(f"{a}+{b}=", str(a + b), {"a": a, "b": b})
                for a, b in seeded_shuffle(pairs, f"moe_rl.toy:{seed}")]
    return build


register_toy_task("add-easy", "a+b with a, b in 0..2 (9 prompts, one-digit answers)", _addition(2))
register_toy_task("add-medium", "a+b with a, b in 0..4 (25 prompts, one-digit answers)", _addition(4))
register_toy_task("add-hard", "a+b with a, b in 0..9 (100 prompts, one- or two-digit answers)",
                  _addition(9))


def _last_parity(seed: int) -> list[ToyExample]:
    """Every `abc=` (a, b, c digits, 1,000 prompts) with answer c mod 2, in a seeded order."""
    triples = [(a, b, c) for a in range(10) for b in range(10) for c in range(10)]
    return [ToyExample(f"{a}{b}{c}=", str(c % 2), {"a": a, "b": b, "c": c})
            for a, b, c in seeded_shuffle(triples, f"moe_rl.toy:{seed}")]


register_toy_task("last-parity", "abc= -> c mod 2 for every three-digit abc (1,000 prompts, answers 0 / 1)",
                  _last_parity)


ECHO_LENGTHS = (1, 1, 1, 2, 2, 3, 4, 6, 12, 32)  # answer length of echo-tail by the prompt's second digit


def _echo_tail(seed: int) -> list[ToyExample]:
    """Every `ab=` (a, b digits, 100 prompts) with answer a repeated ECHO_LENGTHS[b] times."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    return [ToyExample(f"{a}{b}=", str(a) * ECHO_LENGTHS[b], {"a": a, "b": b})
            for a, b in seeded_shuffle(pairs, f"moe_rl.toy:{seed}")]


register_toy_task("echo-tail", "ab= -> the digit a repeated 1..32 times by b (100 prompts, long-tailed lengths)",
                  _echo_tail)


def chance_level(name: str, max_new_tokens: int, vocab_size: int | None = None) -> float:
    """Expected toy reward of a policy sampling uniformly over `vocab_size` tokens.

    Generation stops at `<eos>` or after `max_new_tokens`. An answer of L
    tokens is matched with probability (1/V)^(L+1) when there is room for the
    `<eos>` after it, (1/V)^L when the answer fills `max_new_tokens` exactly,
    and 0 when it does not fit. Averaged over the task's prompts.
    """
    v = vocab_size or len(TOY_TOKENS)
    examples = make_toy_examples(name)

    def p_match(answer_len: int) -> float:
        if answer_len > max_new_tokens:
            return 0.0
        return v ** -(answer_len + (answer_len < max_new_tokens))

    return sum(p_match(len(ex.answer)) for ex in examples) / len(examples)


def save_toy_tokenizer(model_dir: str | Path) -> Path:
    """Write `ToyTokenizer` as a real HF tokenizer (tokenizer.json and its config) into `model_dir`, so a
    fresh tiny model's directory, and its export, load with `AutoTokenizer` and encode text exactly as
    the toy tokenizer does: one id per symbol, whitespace dropped, `<bos>` first with special tokens.
    Built with the `tokenizers` library (a BPE model without merges: every symbol is a token)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TOY_TOKENS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True) for t in TOY_TOKENS[:3]])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    fast.save_pretrained(str(model_dir))
    return Path(model_dir)
