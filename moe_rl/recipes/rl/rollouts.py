"""The step's samples from the rollout engine (rank 0 talks to it, or each data-parallel head for its
own groups): the prompts drawn, the requests asked, the engine's answers made `Samples`
(moe_rl/samples.py).

Two sources give a step its samples, chosen once when the run is built (`run.rollouts`): the
synchronous one (`SyncRollouts`: ask now, wait, train on-policy) and the asynchronous one
(`algo.max_staleness` = K >= 1: `AsyncRollouts`, moe_rl/recipes/rl/async_rollouts.py, keeps the
next K steps generating while this one trains). Both `take(run, step)` the step's batch, hear
the step's metrics (`observe`), `drain` what is in flight, give the data order to save
(`sampler_state`), `reset` after a failed step and `close`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from moe_rl.data.dataset import Prompt
from moe_rl.rollout.engine import GenerateRequest, SamplingParams
from moe_rl.samples import Samples


def next_prompts(run: Any) -> list[Prompt]:
    """The step's next prompts (rank 0 draws them; a data-parallel head takes its block of them:
    moe_rl/recipes/rl/heads.py)."""
    return [run.dataset[i] for i in run.sampler.next_batch()]


def sampling_params(run: Any, seed: int | None, greedy: bool = False) -> SamplingParams:
    r = run.cfg.rollout
    return SamplingParams(temperature=0.0 if greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens, stop_token_ids=(run.eos_id,),
                          n=1 if greedy else r.n_samples, seed=seed)


class SyncRollouts:
    """The synchronous source: each step asks for its batch and waits for it (on-policy), so
    nothing is ever in flight between steps. `draw(run)` draws the prompts, `request(run, prompts,
    step, greedy)` asks the engine: the ones below by default (a data-parallel head's, under
    rollout.intake=heads: moe_rl/recipes/rl/heads.py)."""

    def __init__(self, draw: Callable[[Any], list[Prompt]] | None = None,
                 request: Callable[..., list] | None = None) -> None:
        self.draw, self.request = draw, request

    def take(self, run: Any, step: int) -> tuple[Samples, int, dict[str, float]]:
        prompts = (self.draw or next_prompts)(run)
        return to_samples(run, prompts, (self.request or request)(run, prompts, step, False)), 0, {}

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        """Nothing to adjust: K is 0."""

    def drain(self) -> None:
        """Nothing in flight."""

    def sampler_state(self) -> dict[str, Any] | None:
        return None  # no batch drawn ahead: the sampler's own state is the one to save

    def reset(self, sampler: Any) -> None:
        """Nothing drawn ahead to forget."""

    def close(self) -> None:
        """No threads."""


def rollout(run: Any, step: int) -> tuple[Samples, int, dict[str, float]]:
    """The step's samples, how many weight versions behind the trainer they were asked for, and
    the asynchronous rollouts' metrics.

    With `algo.max_staleness` = K >= 1 the engine generates the next K steps' samples while
    this step trains (rank 0's `run.rollouts` is an AsyncRollouts), so a step
    trains on samples from weights up to K updates old; the trainer's recomputed old log-probs
    and the truncated IS correction (`algo.tis_cap`) account for the difference.
    """
    samples, staleness, metrics = run.rollouts.take(run, step)
    take = getattr(run.engine, "take_stale_resamples", None)  # SGLang servers: samples from other weights
    if take is not None:
        metrics["rollout/stale_resamples"] = float(take())
    return samples, staleness, metrics


def generate(run: Any, prompts: list[Prompt], step: int, greedy: bool = False) -> Samples:
    """Rank 0 asks the engine for G samples per prompt (RolloutError when no server answers)."""
    return to_samples(run, prompts, request(run, prompts, step, greedy))


def request(run: Any, prompts: list[Prompt], step: int, greedy: bool, offset: int = 0) -> list:
    """Rank 0: the engine's outputs as plain Python data. `offset`: the first prompt's place in the
    step's draw (its seed is that place's)."""
    base = run.cfg.model.seed * 1_000_003 + step * 10_007
    requests = [GenerateRequest(prompt_ids=list(p.prompt_ids),
                                sampling=sampling_params(run, base + (offset + i) * 101, greedy),
                                return_routed_experts=run.cfg.rollout.return_routed_experts)
                for i, p in enumerate(prompts)]
    # resumes colocated servers released by the last call; rollout.env: each sample an episode of turns
    results = run.engine.generate(requests) if run.episodes is None else \
        run.episodes.generate(run.engine, prompts, requests)
    if run.cfg.rollout.colocated:
        run.engine.release_memory_occupation()  # training gets the GPU memory back
    episode = lambda r: () if r.action_mask is None else (r.action_mask, r.reward, r.turns)  # noqa: E731
    return [[(r.output_ids, r.output_logprobs, r.routed_experts, r.token_versions(), *episode(r)) for r in per_prompt]
            for per_prompt in results]


def to_samples(run: Any, prompts: list[Prompt], payload: list) -> Samples:
    seqs, plens, logps, routes, texts, owners, versions = [], [], [], [], [], [], []
    actions, env_rewards, turns = [], [], []
    decode = getattr(run.dataset.tokenizer, "decode", None)
    for prompt, per_prompt in zip(prompts, payload):
        for out_ids, out_logp, rts, token_versions, *episode in per_prompt:
            action, reward, n_turns = episode or (None, None, 1)  # an episode's mask, reward and turns
            actions.append(None if action is None else torch.tensor(action, dtype=torch.bool))
            env_rewards.append(reward)
            turns.append(n_turns)
            ids = list(out_ids)
            # an episode's text: its model's last turn, after the environment's last answer (for logs)
            body_from = len(action) - action[::-1].index(False) if action is not None and False in action else 0
            seqs.append(torch.tensor(list(prompt.prompt_ids) + ids, dtype=torch.long))
            plens.append(len(prompt.prompt_ids))
            logps.append(torch.as_tensor(out_logp, dtype=torch.float32))
            routes.append(None if rts is None else torch.as_tensor(rts))
            body = ids[body_from:]
            body = body[: body.index(run.eos_id)] if run.eos_id in body else body
            texts.append(_text(decode, body))
            owners.append(prompt)
            versions.append(None if token_versions is None else
                            torch.tensor([version_number(v) for v in token_versions], dtype=torch.int32))
    # one sample without routes (an aborted request) leaves the others theirs: R3's coverage names it
    has_routes = any(r is not None for r in routes)
    episodes = all(a is not None for a in actions) and bool(actions)
    return Samples(owners, seqs, torch.tensor(plens), logps, routes if has_routes else None, texts,
                   versions=versions if all(v is not None for v in versions) else None,
                   action_masks=actions if episodes else None,
                   env_rewards=torch.tensor(env_rewards, dtype=torch.float32) if episodes else None,
                   turns=torch.tensor(turns, dtype=torch.float32) if episodes else None)


def _text(decode: Any, ids: list[int]) -> str:
    """The completion's text: decoded (an id the tokenizer lacks, e.g. an environment's tool token,
    as `<id N>`), or the ids themselves without a tokenizer."""
    if decode is None:
        return " ".join(map(str, ids))
    try:
        return decode(ids)
    except (ValueError, KeyError, IndexError):
        return "".join(_text(decode, [t]) if len(ids) > 1 else f"<id {t}>" for t in ids)


def version_number(label: str) -> int:
    """The trainer's weight version of an engine's label: our pushes are numbered (the sync's
    version), and the weights a server starts with are version 0 (SGLang labels them "default")."""
    return int(label) if label.isdigit() else 0


def wait_for_prefetch(run: Any) -> None:
    """Let the rollouts asked for ahead (algo.max_staleness) finish before the engine is used otherwise."""
    run.rollouts.drain()
