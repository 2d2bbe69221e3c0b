"""Routing replay of multi-turn episodes: routes merged turn by turn. The weights change between
turns (a push, as under asynchronous RL), so the forward that first processed a position and the
last turn's prefill choose different experts for some of them; every position must keep the first
one's routes (an HF forward of that turn's weights over that turn's context)."""
from __future__ import annotations

import numpy as np
import torch

from moe_rl.data.dataset import Prompt
from moe_rl.env.base import Turn
from moe_rl.rollout.engine import GenerateRequest, SamplingParams
from moe_rl.rollout.episodes import EpisodeRunner


class Answer:
    """Two answers of two ids each, then done at the third turn."""

    stop_token_ids = ()

    def __init__(self):
        self.turn = 0

    def reset(self, prompt):
        return [7]

    def step(self, ids):
        self.turn += 1
        return Turn(observation=[20 + self.turn, 30 + self.turn], done=self.turn >= 3)


class PushAfterEachTurn:
    """The engine, with perturbed router weights pushed after every turn; keeps each version's weights."""

    def __init__(self, engine, gates: dict[str, torch.Tensor]):
        self.engine, self.gates, self.versions = engine, gates, [dict(gates)]
        self.contexts: list[list[int]] = []
        self.g = torch.Generator().manual_seed(1)

    def generate(self, requests):
        out = self.engine.generate(requests)
        self.contexts.append(list(requests[0].prompt_ids) + list(out[0][0].output_ids))
        moved = {n: t + 0.5 * torch.randn(t.shape, generator=self.g) for n, t in self.versions[-1].items()}
        self.engine.update_weights_from_tensors(list(moved.items()), version=str(len(self.versions)))
        self.versions.append(moved)
        return out


def test_each_position_keeps_the_routes_of_the_forward_that_first_processed_it(tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    from moe_rl.drift.routes import hf_forward
    from moe_rl.policy.convert import HFCheckpoint
    from moe_rl.rollout.local_engine import LocalEngine

    ckpt = HFCheckpoint(tiny_hf_dir)
    gates = {n: ckpt.get(n) for n in ckpt.weight_map if n.endswith(".mlp.gate.weight")}
    engine = LocalEngine(tiny_hf_dir, seed=0, max_batch=8)
    pushing = PushAfterEachTurn(engine, gates)
    prompt = Prompt("p", [3, 4, 5, 6], "", None)
    req = GenerateRequest(prompt.prompt_ids, SamplingParams(max_new_tokens=2, ignore_eos=True, seed=5),
                          return_routed_experts=True)
    try:
        (episode,), = EpisodeRunner(Answer, max_turns=3, max_episode_tokens=64, eos_id=2).generate(
            pushing, [prompt], [req])
    finally:
        engine.close()
    assert episode.turns == 3 and list(episode.action_mask) == [False] + [True, True, False, False] * 2 + [True, True]
    merged = episode.routed_experts.astype(np.int64)
    assert merged.shape[0] == len(prompt.prompt_ids) + len(episode.output_ids) - 1

    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()

    def routes(version: int, ids: list[int]) -> np.ndarray:
        model.load_state_dict(pushing.versions[version], strict=False)
        return hf_forward(model, torch.tensor([ids])).routes[0, :-1].numpy()

    expected, start = [], 0
    for turn, ctx in enumerate(pushing.contexts):  # turn t ran under version t, over its own context
        expected.append(routes(turn, ctx)[start:])
        start = len(ctx) - 1
    np.testing.assert_array_equal(merged, np.concatenate(expected))
    last_prefill = routes(2, pushing.contexts[-1])  # what keeping the last request's routes would replay
    first_turns = slice(0, len(pushing.contexts[1]) - 1)
    assert not np.array_equal(merged[first_turns], last_prefill[first_turns])

    # drift by turn compares, for turn t, rows that turn t's own request computed (at turn t's weights):
    # the rows drift_by_turn counts as turn t lie in that request's rows [start, len(context) - 1)
    from moe_rl.samples import Samples
    from moe_rl.recipes.rl.drift_views import route_turns

    sample = Samples([prompt], [torch.tensor(list(prompt.prompt_ids) + list(episode.output_ids))],
                     torch.tensor([len(prompt.prompt_ids)]), [torch.zeros(len(episode.output_ids))], None, [""],
                     action_masks=[torch.tensor(episode.action_mask)])
    rows, start = route_turns(sample, merged.shape[0])[0], 0
    for turn, ctx in enumerate(pushing.contexts):
        counted = (rows == turn).nonzero().view(-1).tolist()
        assert counted and all(start <= r < len(ctx) - 1 for r in counted), (turn, counted, start, len(ctx))
        start = len(ctx) - 1
