"""EpisodeRunner: turns against a scripted engine. Token in, token out (the context of every turn
is exactly the prompt, the model's ids and the environment's ids so far), the action mask, the
budget of turns and tokens, one seed per turn, the environment's stop ids, weight versions."""
from __future__ import annotations

import numpy as np

from moe_rl.data.dataset import Prompt
from moe_rl.env.base import Turn
from moe_rl.rollout.engine import GenerateRequest, GenerateResult, SamplingParams
from moe_rl.rollout.episodes import TURN_SEED_STRIDE, EpisodeRunner

EOS, STOP = 2, 9


class Echo:
    """Answers every turn with [40 + turn number]; ends the episode at turn `end` (done)."""

    stop_token_ids = (STOP,)

    def __init__(self, end: int = 99):
        self.end, self.seen = end, []

    def reset(self, prompt):
        return [30]  # an opening observation

    def step(self, ids):
        self.seen.append(list(ids))
        n = len(self.seen)
        return Turn(observation=[40 + n, 50 + n], reward=0.5, done=n >= self.end)


class Scripted:
    """A fake engine: sample = [seed % 7 + 10, 20 + turn length of the context]; records the calls."""

    def __init__(self, version: str = "3"):
        self.calls: list[list[GenerateRequest]] = []
        self.version = version

    def generate(self, requests):
        self.calls.append(list(requests))
        out = []
        for r in requests:
            ids = [r.sampling.seed % 7 + 10, len(r.prompt_ids)][: r.sampling.max_new_tokens]
            out.append([GenerateResult(list(r.prompt_ids), ids, np.full(len(ids), -0.25), "stop",
                                       weight_version=self.version)])
        return out


def _run(envs, max_turns=3, max_tokens=64, n=2):
    made = iter(envs)
    runner = EpisodeRunner(lambda: next(made), max_turns, max_tokens, EOS)
    engine = Scripted()
    prompt = Prompt("p", [1, 4, 5], "", None)
    req = GenerateRequest(prompt.prompt_ids, SamplingParams(max_new_tokens=2, stop_token_ids=(EOS,), seed=100, n=n))
    return engine, runner.generate(engine, [prompt], [req])[0]


def _one(engine, envs, max_turns, max_tokens, **kw):
    """One episode (n=1, seed 0) of prompt [1, 4, 5] against `engine`."""
    made = iter(envs)
    prompt = Prompt("p", [1, 4, 5], "", None)
    req = GenerateRequest(prompt.prompt_ids, SamplingParams(max_new_tokens=2, seed=0, n=1))
    (ep,), = EpisodeRunner(lambda: next(made), max_turns, max_tokens, EOS, **kw).generate(engine, [prompt], [req])
    return ep


def test_every_turn_sees_exactly_the_ids_so_far_and_the_mask_marks_the_models():
    envs = [Echo(), Echo()]
    engine, (a, b) = _run(envs, max_turns=3)
    assert len(engine.calls) == 3 and [len(c) for c in engine.calls] == [2, 2, 2]  # both episodes each turn
    ctx = [1, 4, 5, 30]
    for turn, call in enumerate(engine.calls):
        req = call[0]
        assert list(req.prompt_ids) == ctx  # the whole context, as ids: nothing decoded and encoded
        assert req.sampling.n == 1 and req.sampling.seed == 100 + turn * TURN_SEED_STRIDE
        assert req.sampling.stop_token_ids == (EOS, STOP)
        assert req.return_routed_experts == (turn == 0)  # asked for; this engine gave none, so not again
        model = [(100 + turn * TURN_SEED_STRIDE) % 7 + 10, len(ctx)]
        assert envs[0].seen[turn] == model
        ctx = ctx + model + ([40 + turn + 1, 50 + turn + 1] if turn < 2 else [])
    assert a.output_ids == ctx[3:]  # everything after the prompt
    assert list(a.action_mask) == [False] + [True, True, False, False] * 2 + [True, True]
    assert a.output_logprobs.tolist() == [0.0] + [-0.25, -0.25, 0.0, 0.0] * 2 + [-0.25, -0.25]
    assert a.reward == 1.5 and a.turns == 3
    assert a.weight_versions == (("3", 0, len(a.output_ids)),)  # the environment's tokens take their turn's version
    assert b.output_ids[1] == (101 % 7) + 10  # the second episode: its own seed


def test_an_episode_ends_when_done_and_the_others_go_on():
    envs = [Echo(end=1), Echo()]
    engine, (a, b) = _run(envs, max_turns=3)
    assert a.turns == 1 and list(a.action_mask) == [False, True, True] and a.reward == 0.5
    assert [len(c) for c in engine.calls] == [2, 1, 1] and b.turns == 3


def test_the_token_budget_cuts_the_observation_and_the_turn():
    engine, (a, _) = _run([Echo(), Echo()], max_turns=5, max_tokens=5)
    # [30] + 2 model + 2 env = 5: the budget is spent by the first answer, which nothing reads: dropped
    assert a.output_ids == [30, 100 % 7 + 10, 4] and a.turns == 1 and a.finish_reason == "length"
    engine, (a, _) = _run([Echo(), Echo()], max_turns=5, max_tokens=6)
    assert engine.calls[1][0].sampling.max_new_tokens == 1 and len(a.output_ids) == 6 and a.turns == 2


class Routed(Scripted):
    """Routes as SGLang returns them with routed_experts_start_len: rows [start, len - 1) only, each
    row tagged with its turn (so the merge can be read back)."""

    def generate(self, requests):
        out = super().generate(requests)
        turn = len(self.calls) - 1
        for r, (res,) in zip(requests, out):
            rows = len(r.prompt_ids) + len(res.output_ids) - 1 - r.routed_experts_start_len
            res.routed_experts = np.full((rows, 1, 1), turn, dtype=np.uint8)
            res.routes_start = r.routed_experts_start_len
        return out


def test_each_turn_asks_only_for_the_rows_not_covered_and_they_are_merged_in_order():
    from moe_rl.rollout.sglang_api import generate_payload

    engine = Routed()
    ep = _one(engine, [Echo(), Echo()], 3, 64)
    starts = [c[0].routed_experts_start_len for c in engine.calls]
    lengths = [len(c[0].prompt_ids) for c in engine.calls]
    assert starts == [0, lengths[0] + 2 - 1, lengths[1] + 2 - 1]  # each turn's last token: the next prefill's
    assert all(generate_payload(c[0])["routed_experts_start_len"] == s for c, s in zip(engine.calls[1:], starts[1:]))
    rows = ep.routed_experts[:, 0, 0].tolist()
    assert len(rows) == 3 + len(ep.output_ids) - 1  # the prompt [1, 4, 5]
    assert rows == [0] * starts[1] + [1] * (starts[2] - starts[1]) + [2] * (len(rows) - starts[2])


def test_an_answer_after_the_last_turn_is_dropped_with_its_missing_routes():
    engine = Routed()
    ep = _one(engine, [Echo(), Echo()], 5, 7)
    # [30] + 2 model + 2 env = 5, then a 2-token turn hits the budget of 7: no environment answer after it
    assert ep.action_mask[-1] and len(ep.output_ids) == 7
    assert ep.routed_experts.shape[0] == 3 + 7 - 1


class Counting(Echo):
    def step(self, ids):
        turn = super().step(ids)
        turn.reward = float(len(self.seen))  # 1, 2, 3
        return turn


def test_the_episode_reward_is_the_sum_of_the_turns_or_the_last_ones():
    for how, want in (("sum", 6.0), ("last", 3.0)):
        ep = _one(Scripted(), [Counting(), Counting()], 3, 64, episode_reward=how)
        assert ep.turns == 3 and ep.reward == want, how


class Pushed(Scripted):
    """A push lands between turns: each call answers under the next version."""

    def generate(self, requests):
        self.version = str(len(self.calls) + 1)
        return super().generate(requests)


def test_an_episode_spanning_a_push_carries_each_tokens_version():
    ep = _one(Pushed(), [Echo(), Echo()], 2, 64)
    # [30] opening, turn 1 (v1) + its answer, turn 2 (v2): the opening takes the first turn's version
    assert ep.weight_versions == (("1", 0, 5), ("2", 5, 7))
    assert ep.token_versions() == ["1"] * 5 + ["2"] * 2
