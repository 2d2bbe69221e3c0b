"""Built-in toy environments, in the toy tasks' token ids (`moe_rl/data/toy.py`), that a tiny
MoE can learn on CPU. Prompts come from the toy addition tasks (`data.train=toy:add-...`), whose
rows carry their operands.

calculator: a tool. The model calls it with the `<calc>` token (id 16, beyond the toy
    vocabulary: `model.tiny.vocab_size >= 17`); the environment answers with the digits of the
    prompt's sum, and the model must then answer with them (up to EOS, or the whole turn when
    it ends on `rollout.max_new_tokens`, as the toy tasks judge). The call earns 0.2 and a right
    answer after it 1.0 (`require_call`: an answer without a call earns nothing, so the task is
    to use the tool, not to add). One call per episode; a second ends it unanswered.
guess: a game. The secret is the prompt's answer digit; the model guesses a digit and EOS, and
    the environment answers `+` (the secret is higher) or `-` (lower) until it is found or
    `rollout.max_turns` runs out.

An episode's reward is the sum of its turns'; it succeeds (`reward/success_rate`) at 1.0 or more.
"""
from __future__ import annotations

from moe_rl.data.dataset import Prompt
from moe_rl.data.toy import TOY_TOKENS, ToyTokenizer
from moe_rl.env.base import Turn

CALL = len(TOY_TOKENS)  # "<calc>": the first id after the toy vocabulary
_TOK = ToyTokenizer()


def _operands(prompt: Prompt) -> tuple[int, int]:
    """The a, b of an `a+b=` toy prompt (its row's metadata, else its ids)."""
    if "a" in prompt.metadata and "b" in prompt.metadata:
        return int(prompt.metadata["a"]), int(prompt.metadata["b"])
    text = _TOK.decode([t for t in prompt.prompt_ids if t < CALL], skip_special_tokens=True)
    left, plus, right = text.rstrip("=").partition("+")
    if not plus or not left.isdigit() or not right.isdigit():
        raise ValueError(f"prompt {prompt.uid}: {text!r} is not an a+b= problem (use a toy:add-... task)")
    return int(left), int(right)


def _digits(ids: list[int], eos_id: int) -> str:
    """The text of a turn's ids up to EOS or a call; '' when any of them is not a digit."""
    body = []
    for t in ids:
        if t in (eos_id, CALL):
            break
        body.append(t)
    text = _TOK.decode(body) if all(0 <= t < CALL for t in body) else ""
    return text if text.isdigit() else ""


class CalculatorEnv:
    """The `<calc>` tool (see the module docstring)."""

    stop_token_ids = (CALL,)

    CALL_REWARD = 0.2  # dense enough that calling is learned first, then answering with the result

    def __init__(self, eos_id: int = _TOK.eos_token_id, vocab_size: int | None = None,
                 require_call: bool = True) -> None:
        if vocab_size is not None and vocab_size <= CALL:
            raise ValueError(f"rollout.env=calculator: the <calc> token is id {CALL}, so the model needs "
                             f"model.tiny.vocab_size >= {CALL + 1} (it has {vocab_size})")
        self.eos_id, self.require_call, self.calls, self.target = eos_id, require_call, 0, ""

    def reset(self, prompt: Prompt) -> list[int]:
        a, b = _operands(prompt)
        self.target, self.calls = str(a + b), 0
        return []

    def step(self, completion_ids: list[int]) -> Turn:
        if completion_ids and completion_ids[-1] == CALL:
            self.calls += 1
            if self.calls > 1:
                return Turn(done=True, info={"calls": self.calls})
            return Turn(observation=_TOK.encode(self.target), reward=self.CALL_REWARD, info={"calls": 1})
        right = _digits(completion_ids, self.eos_id) == self.target and (self.calls or not self.require_call)
        return Turn(reward=float(right), done=True, info={"calls": self.calls})


class GuessEnv:
    """Guess the prompt's answer digit with higher / lower feedback (see the module docstring)."""

    stop_token_ids = ()

    def __init__(self, eos_id: int = _TOK.eos_token_id) -> None:
        self.eos_id, self.secret = eos_id, 0

    def reset(self, prompt: Prompt) -> list[int]:
        if prompt.answer is None or not str(prompt.answer).isdigit() or len(str(prompt.answer)) != 1:
            raise ValueError(f"prompt {prompt.uid}: rollout.env=guess needs a one-digit answer, "
                             f"got {prompt.answer!r} (use toy:add-easy or toy:add-medium)")
        self.secret = int(prompt.answer)
        return []

    def step(self, completion_ids: list[int]) -> Turn:
        guess = _digits(completion_ids, self.eos_id)
        if guess == str(self.secret):
            return Turn(reward=1.0, done=True)
        if not guess:
            return Turn(done=True, info={"invalid": True})  # not a number: the game ends
        return Turn(observation=_TOK.encode("+" if self.secret > int(guess) else "-"))
