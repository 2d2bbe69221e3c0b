"""The asynchronous rollouts of algo.max_staleness = K (moe_rl/recipes/rl/async_rollouts.py) against the
synchronous schedule: the same prompts in the same order, at most K versions old, every prompt
trained once across a checkpoint and a failed step, and stale groups generated again."""
from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from moe_rl.data.sampler import PromptSampler
from moe_rl.samples import Samples
from moe_rl.recipes.rl.async_rollouts import AsyncRollouts, check_staleness

G = 2  # samples per prompt


def _run(seed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(sampler=PromptSampler(40, 4, seed=seed), weight_version=0, server_version=0,
                           cfg=SimpleNamespace(rollout=SimpleNamespace(n_samples=G)), lag_of=None)


def _next_prompts(run):
    return run.sampler.next_batch()


def _request(run, prompts, step, greedy):
    """The engine: G samples per prompt, each token labelled with the weights the server holds
    (`lag_of(prompt)`: this many versions older, a server that fell behind)."""
    lag = run.lag_of or (lambda p: 0)
    return [[(p, run.server_version - lag(p))] * G for p in prompts]


def _samples_of(run, prompts, payload):
    owners = [p for p, per in zip(prompts, payload) for _ in per]
    versions = [torch.full((2,), v, dtype=torch.int32) for per in payload for _, v in per]
    return Samples(owners, [torch.tensor([p, p, p]) for p in owners], torch.ones(len(owners), dtype=torch.long),
                   [torch.zeros(2) for _ in owners], None, [""] * len(owners), versions=versions)


def _pipe(k, governor=None):
    return AsyncRollouts(k, governor, request=_request, samples_of=_samples_of, draw=_next_prompts)


def _train(run, pipe, steps, start=1):
    """Run `steps` steps; each one's prompts and lag. A step's update lands on the servers at once."""
    out = []
    for step in range(start, start + steps):
        samples, lag, metrics = pipe.take(run, step)
        pipe.drain()  # deterministic: every batch asked for is generated before the push
        out.append((samples.prompts[::G], lag, metrics["rollout/dropped_stale_groups"]))
        run.weight_version += 1
        run.server_version = run.weight_version
    return out


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_prompts_are_the_synchronous_runs_and_at_most_k_versions_old(k):
    sync = PromptSampler(40, 4, seed=0)
    want = [sync.next_batch() for _ in range(9)]
    run, pipe = _run(), _pipe(k)
    got = _train(run, pipe, 9)
    assert [p for p, _, _ in got] == want
    assert [lag for _, lag, _ in got] == [min(s, k) for s in range(9)]  # K behind once the pipeline is full
    pipe.close()


def test_a_checkpoint_resumes_at_the_first_batch_not_trained():
    run, pipe = _run(), _pipe(3)
    done = _train(run, pipe, 4)
    saved = pipe.sampler_state()  # what RLRecipe.state_dict saves as the data order
    rest = _train(run, pipe, 3, start=5)
    again = _run()
    again.sampler.load_state_dict(saved)
    resumed = _train(again, _pipe(3), 3, start=5)
    assert [p for p, _, _ in resumed] == [p for p, _, _ in rest]  # no batch skipped, none twice
    assert len({tuple(p) for p, _, _ in done + rest}) == 7


def test_a_failed_step_asks_for_its_batch_again():
    run, pipe = _run(), _pipe(2)
    _train(run, pipe, 2)
    nxt = pipe.asked[0].prompts
    pipe.take(run, 3)  # step 3 starts ... and fails
    pipe.reset(run.sampler)                                  # (RLRecipe.undo_draws)
    retried = _train(run, pipe, 1, start=3)
    assert retried[0][0] == nxt


def test_a_group_from_weights_more_than_k_versions_old_is_generated_again():
    run, pipe = _run(), _pipe(1)
    _train(run, pipe, 3)
    victim = pipe.asked[0].prompts[1]
    run.lag_of = lambda p: 5 if p == victim else 0  # one server far behind, for one prompt's request
    run.server_version = run.weight_version
    pipe.drain()
    head = pipe.asked[0]
    head.future = Future()
    head.future.set_result(_request(run, head.prompts, head.step, False))
    run.lag_of = None  # generated again from current weights
    samples, lag, metrics = pipe.take(run, 4)
    assert metrics["rollout/dropped_stale_groups"] == 1.0 and samples.prompts[::G] == head.prompts
    assert int(torch.cat(samples.versions).min()) >= run.weight_version - 1
    pipe.close()


def test_a_token_beyond_the_bound_is_an_error():
    check_staleness({"rollout/staleness_max": 2.0}, 2)
    with pytest.raises(RuntimeError, match="3 weight versions old, beyond algo.max_staleness=2"):
        check_staleness({"rollout/staleness_max": 3.0}, 2)


def test_the_governor_lowers_k_after_steps_of_high_kl_and_the_prompts_keep_the_synchronous_order():
    """algo.auto_staleness: two steps in a row with loss/approx_kl above the bar lower K by one; a calm
    step resets the count. Lowered from 2 to 0, the run asks nothing ahead (on-policy: lag 0), and
    no prompt is skipped or trained twice on the way."""
    from moe_rl.recipes.rl.async_rollouts import StalenessGovernor

    sync = PromptSampler(40, 4, seed=0)
    want = [sync.next_batch() for _ in range(9)]
    run, pipe = _run(), _pipe(2, StalenessGovernor(kl=0.15, steps=2))
    kl = {1: 0.01, 2: 0.3, 3: 0.01, 4: 0.3, 5: 0.4, 6: 0.2, 7: 0.5, 8: 0.9, 9: 0.9}
    got, bounds = [], []
    for step in range(1, 10):
        samples, lag, metrics = pipe.take(run, step)
        pipe.drain()
        got.append((samples.prompts[::G], lag))
        bounds.append(metrics["rollout/staleness_bound"])
        pipe.observe(step, {"loss/approx_kl": kl[step]})
        run.weight_version += 1
        run.server_version = run.weight_version
    assert [p for p, _ in got] == want
    assert bounds == [2, 2, 2, 2, 2, 1, 1, 0, 0]  # lowered after steps 5 and 7 (two hot steps each)
    # a batch keeps the K it was asked for with: step 7's at step 5 (K 2), step 8's at step 7 (K 1);
    # from step 9 each step generates its own (on-policy)
    assert [lag for _, lag in got][-3:] == [2, 1, 0]
    assert max(lag for _, lag in got) <= 2
    pipe.close()
