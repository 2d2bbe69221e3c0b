"""The GSPO minibatches the update tests share (tests/distributed/test_train_step_reference.py,
tests/distributed/test_replay_updates.py, tests/distributed/test_first_update_pi_old.py): 12 short
sequences, the pad token fed as an input in some, their advantages, three minibatches of four, the
completion mask; and how those tests compare the weights their updates export."""
from __future__ import annotations

from pathlib import Path

import torch

PAD = 0  # the tiny checkpoint's pad_token_id


def gspo_batch() -> tuple[list[torch.Tensor], list[int], torch.Tensor, list[list[int]]]:
    """12 sequences (prompt of 5, completion of 1-3 tokens), their prompt lengths, advantages,
    three minibatches."""
    g = torch.Generator().manual_seed(7)
    seqs, plens = [], []
    for i in range(12):
        prompt = [1] + torch.randint(3, 128, (4,), generator=g).tolist()
        completion = torch.randint(3, 128, (1 + i % 3,), generator=g).tolist()
        if i % 4 == 1 and len(completion) > 1:
            completion[0] = PAD  # the pad token as an input: it predicts the next completion token
        seqs.append(torch.tensor(prompt + completion))
        plens.append(len(prompt))
    adv = torch.randn(12, generator=g)
    return seqs, plens, adv, [[0, 5, 9, 2], [7, 1, 11, 4], [3, 10, 6, 8]]


def completion_mask(seqs: list[torch.Tensor], plens: list[int], width: int) -> torch.Tensor:
    """`[B, width]`: 1 where position t predicts a completion token."""
    t = torch.arange(width).view(1, -1)
    lengths = torch.tensor([s.shape[0] for s in seqs]).view(-1, 1)
    return ((t >= torch.tensor(plens).view(-1, 1) - 1) & (t < lengths - 1)).float()


def hf_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """A HF checkpoint's parameters in fp32, by name (what an update test's ranks exported)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return {n: p.detach() for n, p in model.named_parameters()}


def update_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                  start: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor of `want`: how far the update `got - start` is from `want - start`, as a fraction
    of the latter's norm."""
    out = {}
    for n, w in want.items():
        step = w - start[n]
        out[n] = float((got[n] - start[n] - step).norm() / step.norm().clamp_min(1e-12))
    return out
