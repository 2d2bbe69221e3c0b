"""Reward of the built-in toy tasks: exact match of the completion with the answer."""
from __future__ import annotations

from typing import TYPE_CHECKING

from moe_rl.data.toy import ToyTokenizer
from moe_rl.reward.registry import register_reward

if TYPE_CHECKING:
    from moe_rl.data.dataset import Prompt

__all__ = ["toy_exact_match"]

_TOKENIZER = ToyTokenizer()
_EOS_TEXT = "<eos>"


@register_reward("toy", reads_ids=False)
def toy_exact_match(completion_text: str, answer: str | None, *, prompt: Prompt | None = None,
                    completion_ids: list[int] | None = None, **metadata: object) -> float:
    """1.0 when the completion up to its first EOS is exactly the answer, else 0.0.

    With `completion_ids` the ids before the first EOS must equal the answer's
    ids (any PAD/BOS among them is a miss). Without ids, the text before the
    first "<eos>" is compared, ignoring whitespace. A completion that stopped
    at max_new_tokens without EOS is judged on all of it.
    """
    if answer is None:
        raise ValueError("toy reward needs a reference answer, and this prompt has none")
    if completion_ids is not None:
        ids = list(completion_ids)
        if _TOKENIZER.eos_token_id in ids:
            ids = ids[:ids.index(_TOKENIZER.eos_token_id)]
        return 1.0 if ids == _TOKENIZER.encode(answer) else 0.0
    text = completion_text.split(_EOS_TEXT, 1)[0]
    return 1.0 if "".join(text.split()) == "".join(answer.split()) else 0.0
