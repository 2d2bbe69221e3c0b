"""Pure helpers of the RL loop."""
from __future__ import annotations

import pytest

from moe_rl.samples import usable_groups


@pytest.mark.parametrize("kept,g,unit,expected", [
    (5, 16, 4, 5),   # every group fits
    (3, 6, 4, 2),    # 18 samples do not split into 4 shares, 12 do
    (3, 3, 4, 0),    # no number of 3-sample groups up to 3 splits into 4
    (4, 3, 4, 4),    # 12 samples
    (0, 8, 2, 0),    # everything was filtered
])
def test_usable_groups_keeps_the_most_whole_groups_that_split_evenly(kept, g, unit, expected):
    assert usable_groups(kept, g, unit) == expected


@pytest.mark.parametrize("dp,m", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_share_indices_same_minibatches_either_way_and_balanced_by_tokens(dp, m):
    import random

    from moe_rl.samples import share_indices

    rng = random.Random(dp * 10 + m)
    lengths = [rng.randint(16, 1024) for _ in range(32)]
    plain = [share_indices(lengths, dp, r, m, by_tokens=False) for r in range(dp)]
    packed = [share_indices(lengths, dp, r, m, by_tokens=True) for r in range(dp)]
    for k in range(m):
        a = sorted(i for r in range(dp) for i in plain[r][k])
        b = sorted(i for r in range(dp) for i in packed[r][k])
        assert a == b, "minibatch k holds the same samples whichever way it is spread"
        assert all(len(plain[r][k]) == 32 // (dp * m) for r in range(dp))
        tok_packed = [sum(lengths[i] for i in packed[r][k]) for r in range(dp)]
        assert max(tok_packed) - min(tok_packed) <= max(lengths)  # the greedy rule's bound
    assert sorted(i for r in range(dp) for mb in plain[r] for i in mb) == list(range(32))


def _share(shuffle: bool, step: int, dp: int = 2, rank: int = 0) -> list[list[int]]:
    """my_share on 4 prompts x 4 samples (sequence i is [i, i]) split into 2 minibatches:
    the sample ids each minibatch of `rank` holds."""
    from types import SimpleNamespace

    import torch

    from moe_rl.samples import Samples

    from moe_rl.recipes.rl.batch import my_share

    n = 16
    samples = Samples(prompts=list(range(n)), sequences=[torch.tensor([i, i]) for i in range(n)],
                      prompt_lens=torch.ones(n, dtype=torch.long), engine_logp=[torch.zeros(1)] * n, routes=None,
                      completions=[""] * n, rewards=torch.arange(n, dtype=torch.float32))
    cfg = SimpleNamespace(algo=SimpleNamespace(shuffle_minibatches=shuffle, num_minibatches=2),
                          data=SimpleNamespace(shuffle_seed=0))
    run = SimpleNamespace(cfg=cfg, policy=SimpleNamespace(dp_size=dp, dp_rank=rank, packs_sequences=False))
    share = my_share(run, samples, step)
    assert share.samples.rewards.tolist() == [float(p) for p in share.samples.prompts]  # rows stay together
    return [[int(share.samples.sequences[i][0]) for i in mb] for mb in share.minibatches]


def test_my_share_shuffles_the_samples_into_minibatches_per_step():
    plain = [_share(False, 1, rank=r) for r in range(2)]
    assert plain[0] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # prompt order: rank 0 holds prompts 0 and 1
    shuffled = [_share(True, 1, rank=r) for r in range(2)]
    assert shuffled == [_share(True, 1, rank=r) for r in range(2)]  # seeded: every rank computes the same
    assert sorted(i for share in shuffled for mb in share for i in mb) == list(range(16))  # each sample once
    assert shuffled != plain
    first = sorted(i for share in shuffled for i in share[0])  # the first update's samples, over both ranks
    assert len({i // 4 for i in first}) > 2, "the first update sees samples of more than two prompts"
    assert _share(True, 2) != shuffled[0]  # a new order every step


def test_share_indices_refuses_uneven_split():
    from moe_rl.samples import share_indices

    with pytest.raises(ValueError, match="2 data-parallel ranks x 2 minibatches.*multiple of 4"):
        share_indices([5] * 6, 2, 0, 2, by_tokens=False)


def test_share_indices_by_tokens_lowers_the_busiest_rank():
    """Over many batches with lengths 16..1024 the busiest rank holds fewer tokens on average."""
    import random

    from moe_rl.samples import share_indices

    rng = random.Random(0)
    busiest = {False: 0, True: 0}
    for _ in range(50):
        lengths = [rng.randint(16, 1024) for _ in range(64)]
        for by_tokens in busiest:
            shares = [share_indices(lengths, 4, r, 2, by_tokens)[0] for r in range(4)]
            busiest[by_tokens] += max(sum(lengths[i] for i in s) for s in shares)
    assert busiest[True] < 0.9 * busiest[False]


class _OneRank:
    """What `combine_loss_metrics` needs of a Policy, for a single process."""

    reports_loss = True

    def all_reduce_sum(self, values, group="dp"):
        return values

    def all_reduce_max(self, values, group="dp"):
        return values


def test_combine_loss_metrics_over_microbatches():
    from moe_rl.recipes.common import combine_loss_metrics

    mbs = [
        {"loss/pg_loss": 0.25, "loss/num_tokens": 10.0, "loss/ratio_mean": 1.0, "loss/ratio_min": 0.9,
         "loss/ratio_max": 1.1, "loss/clip_frac_high": 0.0},
        {"loss/pg_loss": -0.5, "loss/num_tokens": 30.0, "loss/ratio_mean": 2.0, "loss/ratio_min": 0.8,
         "loss/ratio_max": 1.05, "loss/clip_frac_high": 0.5},
        # an ignored microbatch (padding rows only): no tokens, extremes of an empty set
        {"loss/pg_loss": 0.0, "loss/num_tokens": 0.0, "loss/ratio_mean": 0.0, "loss/ratio_min": 0.0,
         "loss/ratio_max": 0.0, "loss/clip_frac_high": 0.0},
    ]
    out = combine_loss_metrics(_OneRank(), mbs)
    assert out["loss/pg_loss"] == pytest.approx(-0.25)  # shares of a globally normalised loss add up
    assert out["loss/num_tokens"] == 40.0
    assert out["loss/ratio_mean"] == pytest.approx((10 * 1.0 + 30 * 2.0) / 40)  # token-weighted mean
    assert out["loss/clip_frac_high"] == pytest.approx(30 * 0.5 / 40)
    assert out["loss/ratio_min"] == pytest.approx(0.8) and out["loss/ratio_max"] == pytest.approx(1.1)


def test_combine_loss_metrics_rank_without_metrics_contributes_nothing():
    from moe_rl.recipes.common import combine_loss_metrics

    class Stage(_OneRank):
        reports_loss = False

    out = combine_loss_metrics(Stage(), [{"loss/pg_loss": 1.0, "loss/num_tokens": 5.0, "loss/ratio_min": 0.5}])
    assert out == {}  # alone, a rank that does not report has nothing to combine


# -- DAPO dynamic sampling with refill rounds, rewards on completion ids --------------------

class _ScriptedEngine:
    """Round r makes the first `informative[r]` groups informative: one sample of such a group
    starts with token 7 (reward 1), every other sample is [8] or [8, 8, 8] (reward 0; the
    lengths differ so overlong shaping would make the group look informative)."""

    def __init__(self, informative: list[int]) -> None:
        self.informative = informative
        self.calls = 0

    def generate(self, requests):
        from moe_rl.rollout.engine import GenerateResult

        k = self.informative[self.calls]
        self.calls += 1
        out = []
        for i, req in enumerate(requests):
            ids = [[7] if (i < k and j == 0) else ([8] if j % 2 else [8, 8, 8]) for j in range(req.sampling.n)]
            out.append([GenerateResult(prompt_ids=list(req.prompt_ids), output_ids=x, output_logprobs=[-1.0] * len(x),
                                       finish_reason="length") for x in ids])
        return out


def _reward_first_token_is_7(completion_text, answer, *, completion_ids):
    return float(completion_ids[0] == 7)


def _scripted_run(informative: list[int], *overrides: str):
    from types import SimpleNamespace

    from moe_rl.config import load_config
    from moe_rl.data.dataset import load_dataset
    from moe_rl.data.sampler import PromptSampler
    from moe_rl.recipes.rl.run import Run
    from moe_rl.reward.runner import RewardRunner

    cfg = load_config(None, ["data.prompts_per_step=4", "rollout.n_samples=4", "algo.num_minibatches=2",
                             "algo.dynamic_sampling=true", *overrides])
    data = load_dataset("toy:add-easy")
    return Run(cfg=cfg, policy=SimpleNamespace(dp_size=1), dataset=data,
               sampler=PromptSampler(len(data), 4, seed=0), rewards=RewardRunner(_reward_first_token_is_7),
               engine=_ScriptedEngine(informative), weight_sync=None, eos_id=2)


def test_dynamic_sampling_refills_until_the_step_has_its_groups():
    from moe_rl.recipes.rl.batch import advantages_and_filters, dynamic_sampling_rounds, score
    from moe_rl.recipes.rl.rollouts import generate, next_prompts

    run = _scripted_run([1, 2, 4], "algo.overlong_max_len=2")
    first = generate(run, next_prompts(run), 1)
    score(run, first)
    kept, m = dynamic_sampling_rounds(run, first, 1)
    # rounds: 1 + 2 + 4 informative groups; the step wants 4 and takes the first 4 in order
    assert m == {"filter/rounds": 3.0, "filter/generated_groups": 12.0, "filter/kept_groups": 4.0,
                 "filter/dropped_groups": 8.0}
    assert len(kept) == 16 and run.engine.calls == 3
    assert kept.rewards.view(4, 4).tolist() == [[1.0, 0.0, 0.0, 0.0]] * 4  # each kept group has one success
    assert [kept.prompts[4 * i] is kept.prompts[4 * i + 3] for i in range(4)] == [True] * 4
    shaped, _ = advantages_and_filters(run, kept)
    assert shaped.advantages.view(4, 4)[:, 0].gt(0).all()


def test_dynamic_sampling_filters_on_task_reward_not_on_shaped_reward():
    from moe_rl.recipes.rl.batch import dynamic_sampling_rounds, score
    from moe_rl.recipes.rl.rollouts import generate, next_prompts

    run = _scripted_run([0], "algo.overlong_max_len=2", "algo.dynamic_sampling_max_rounds=1")
    samples = generate(run, next_prompts(run), 1)
    score(run, samples)
    kept, m = dynamic_sampling_rounds(run, samples, 1)
    # every group's task rewards are 0: nothing is informative, whatever the length penalty says
    assert kept is None and m["filter/skipped_step"] == 1.0 and m["filter/kept_groups"] == 0.0


def test_dynamic_sampling_reports_what_is_trained_on():
    from moe_rl.recipes.rl.batch import dynamic_sampling_rounds, score
    from moe_rl.recipes.rl.rollouts import generate, next_prompts

    run = _scripted_run([3, 0], "algo.dynamic_sampling_max_rounds=2")
    samples = generate(run, next_prompts(run), 1)
    score(run, samples)
    kept, m = dynamic_sampling_rounds(run, samples, 1)
    # 3 informative groups after 2 rounds: 12 samples split into 2 minibatches, all are used
    assert m["filter/kept_groups"] * 4 == len(kept) == 12 and m["filter/rounds"] == 2.0


def test_rewards_get_completion_ids():
    from moe_rl.recipes.rl.rollouts import generate, next_prompts
    from moe_rl.recipes.rl.batch import score

    run = _scripted_run([4], "algo.dynamic_sampling=false")
    samples = generate(run, next_prompts(run), 1)
    score(run, samples)
    assert samples.rewards.view(4, 4)[:, 0].tolist() == [1.0] * 4  # read from the ids, not the text
    assert samples.completion_ids()[:3] == [[7], [8], [8, 8, 8]]


def test_text_only_reward_without_a_tokenizer_is_refused_before_any_work(tmp_path):
    """Id-only data and no tokenizer: a reward that reads only text would score empty strings."""
    import json

    from moe_rl.config import ConfigError, load_config
    from moe_rl.recipes.build import build_run

    data = tmp_path / "ids.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": [5, 6, 7], "answer": "3"}) for _ in range(4)) + "\n")
    cfg = load_config(None, [f"data.train={data}", "data.eval=null", "reward.name=math", "data.prompts_per_step=4"])
    with pytest.raises(ConfigError, match="reward.name='math' reads only the completion text.*completion_ids"):
        build_run(cfg, tmp_path / "run", 0)
    assert not (tmp_path / "run" / "init_model").exists()  # refused before the model was written


def test_a_stop_token_ends_the_completion_and_is_trained():
    """Completions end at the engine's stop token (`<eos>`, even as the first token); the
    response mask covers every completion token, the stop token included, and nothing after."""
    from types import SimpleNamespace

    from moe_rl.data.toy import ToyTokenizer
    from moe_rl.samples import response_mask
    from moe_rl.recipes.rl.batch import sample_stats, staleness_of
    from moe_rl.recipes.rl.rollouts import to_samples

    tok = ToyTokenizer()
    run = SimpleNamespace(dataset=SimpleNamespace(tokenizer=tok), eos_id=tok.eos_token_id)
    prompt = SimpleNamespace(prompt_ids=tok.encode("<bos>123="))
    outputs = [([2], [-2.0], None, ["3"]), ([4, 2], [-1.0, -0.5], None, ["3", "4"]),
               ([4, 5], [-1.0, -3.0], None, ["default", "4"])]  # the engine's per-token weight versions
    s = to_samples(run, [prompt], [outputs])
    assert s.completion_ids() == [[2], [4, 2], [4, 5]] and s.completions == ["", "1", "12"]
    assert [v.tolist() for v in s.versions] == [[3], [3, 4], [0, 4]]  # "default": the starting weights
    run.weight_version = 5  # per token: 2; 2, 1; 5, 1 versions behind
    assert staleness_of(sample_stats(s, run.weight_version)) == pytest.approx({"rollout/staleness_mean": 2.2,
                                                                      "rollout/staleness_max": 5.0,
                                                                      "rollout/partial_frac": 2 / 3})  # two span two versions
    mask = response_mask(s, max(s.lengths()) - 1)
    p = len(prompt.prompt_ids)
    assert mask.tolist() == [[0.0] * (p - 1) + [1.0, 0.0], [0.0] * (p - 1) + [1.0, 1.0], [0.0] * (p - 1) + [1.0, 1.0]]


def test_each_position_is_lagged_by_the_weights_that_computed_it():
    # prompt of 3 then completion tokens from versions 4, 4, 5: positions 0, 1 (prefill) go with the
    # first token, position 2 produced token 0, 3 token 1, 4 token 2; the old pass is at version 5
    import torch

    from moe_rl.samples import Samples
    from moe_rl.recipes.rl.drift_views import position_lags

    s = Samples(prompts=[0, 1], sequences=[torch.arange(6), torch.arange(4)], prompt_lens=torch.tensor([3, 3]),
                engine_logp=[torch.zeros(3), torch.zeros(1)], routes=None, completions=["", ""],
                versions=[torch.tensor([4, 4, 5], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)])
    assert position_lags(s, 6, 5).tolist() == [[1, 1, 1, 1, 0, -1], [0, 0, 0, -1, -1, -1]]
    # retracted at the push to 5, sample 0 was prefilled again: all its routes are version 5's
    assert position_lags(s, 6, 5, retracted=True).tolist() == [[0, 0, 0, 0, 0, -1], [0, 0, 0, -1, -1, -1]]


def _episodes(*episodes):
    """Samples of multi-turn episodes: (prompt length, completion action mask) each."""
    import torch

    from moe_rl.samples import Samples

    return Samples(prompts=list(range(len(episodes))), sequences=[torch.arange(p + len(a)) for p, a in episodes],
                   prompt_lens=torch.tensor([p for p, _ in episodes]),
                   engine_logp=[torch.zeros(len(a)) for _, a in episodes], routes=None, completions=[""] * len(episodes),
                   action_masks=[torch.tensor(a, dtype=torch.bool) for _, a in episodes])


# Two episodes with known rows. Row t routes token t and produces token t + 1; C: a row whose next token
# is the prompt's or the environment's, N: no row (a sample's last token, padding).
#   A: prompt p0 p1 p2, the environment's opening o, turn 0 m00 m01, answer a0 a1, turn 1 m10
#   B (the calculator tool's shape): prompt p0 p1 p2, turn 0 m0 (the call), answer a, turn 1 m1
EPISODE_A = (3, [0, 1, 1, 0, 0, 1])
EPISODE_B = (3, [1, 0, 1])
C, N = -1, -2
ROWS_A = [C, C, C, 0, 0, C, C, 1, N]   # p0 p1 p2 o m00 m01 a0 a1 | m10
ROWS_B = [C, C, 0, C, 1, N, N, N, N]   # p0 p1 p2 m0 a | m1, padding


def test_route_rows_count_for_the_turn_of_the_token_they_produce_and_context_apart():
    from moe_rl.recipes.rl.drift_views import CONTEXT, NO_ROW, route_turns

    assert (CONTEXT, NO_ROW) == (C, N)
    s = _episodes(EPISODE_A, EPISODE_B)
    assert route_turns(s, 9).tolist() == [ROWS_A, ROWS_B]
    assert route_turns(s, 6).tolist() == [ROWS_A[:6], ROWS_B[:6]]  # cut at the width


def test_drift_by_turn_counts_each_turns_rows_and_the_context_apart():
    """Hand-built routes (one MoE layer, top-2) whose change depends on the row's turn, so each key's value
    is known: after the updates turn 0's rows keep their experts, turn 1's change one of two (0.5) and the
    context's both (1.0); the engine differs from the trainer by one expert on turn 0's rows only; the
    trainer's log-probs differ from the engine's by 0.25 on turn 1's tokens only. The turn-1 keys had
    no tokens when rows counted as the turn of their own token (the tool episode's turn 1 is its last token)."""
    from types import SimpleNamespace

    import torch

    from moe_rl.samples import response_mask
    from moe_rl.recipes.rl.drift_views import drift_by_turn

    s, width = _episodes(EPISODE_A, EPISODE_B), 8
    rows = torch.tensor([ROWS_A[:width], ROWS_B[:width]])
    tokens = rows != N
    n = int(tokens.sum())
    before = torch.tensor([[0, 1]]).expand(n, 1, 2).clone()
    turn = rows[tokens]  # hand-written turns of the routed rows, in the order step_drift flattens them
    after = torch.where((turn == 1).view(-1, 1, 1), torch.tensor([0, 2]), before)
    after = torch.where((turn == C).view(-1, 1, 1), torch.tensor([3, 4]), after)
    engine = torch.where((turn == 0).view(-1, 1, 1), torch.tensor([5, 1]), before)
    engine_logp = torch.zeros(2, width)
    trainer_logp = torch.where(rows == 1, 0.25, 0.0)
    run = SimpleNamespace(policy=SimpleNamespace(arch=SimpleNamespace(moe_layers=(1,)), dp_group=None),
                          cfg=SimpleNamespace(rollout=SimpleNamespace(max_turns=2)))
    out = drift_by_turn(run, s, SimpleNamespace(trainer_logp=trainer_logp), before, after, engine, tokens,
                        response_mask(s, width).bool(), engine_logp, torch.ones(n, dtype=torch.bool))
    assert out["drift/volatility_by_turn/1/num_tokens"] == out["drift/rollout_mismatch_by_turn/1/num_tokens"] == 2.0
    assert out["drift/volatility_by_turn/0/num_tokens"] == 3.0
    assert out["drift/volatility_by_turn/context/num_tokens"] == 8.0  # with the turns', every routed row once
    assert (out["drift/volatility_by_turn/0"], out["drift/volatility_by_turn/1"],
            out["drift/volatility_by_turn/context"]) == (0.0, 0.5, 1.0)
    assert out["drift/volatility_by_turn/1/layer_01"] == 0.5
    assert (out["drift/rollout_mismatch_by_turn/0"], out["drift/rollout_mismatch_by_turn/1"],
            out["drift/rollout_mismatch_by_turn/context"]) == (0.5, 0.0, 0.0)
    assert out["drift/logp_by_turn/0/abs_diff"] == 0.0 and out["drift/logp_by_turn/1/abs_diff"] == 0.25
    assert "drift/logp_by_turn/context/abs_diff" not in out  # the context was not sampled
