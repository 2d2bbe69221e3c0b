"""The GSPO minibatches the update tests share (tests/distributed/test_train_step_reference.py,
tests/distributed/test_replay_updates.py): 12 short sequences, the pad token fed as an input in
some, their advantages, three minibatches of four, and the completion mask."""
from __future__ import annotations

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
