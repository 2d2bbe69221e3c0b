"""The step's batch when each data-parallel head receives its own samples (`rollout.intake=heads`).

    rank 0 draws the step's prompt groups (the sampler, DAPO's refill rounds, the resume state)
      and sends their dataset indices to the heads: the first rank of each model-parallel group;
    each head asks the servers for its block of the groups, receives and checks their replies,
      scores them and computes their advantages (GRPO/GSPO/DAPO statistics are per group, and a
      group lives on one head);
    the heads share a few numbers per sample (`batch.sample_stats`: rewards, lengths), so each
      computes the same metrics, DAPO's kept groups and the same token-balanced plan;
    samples move head to head only where the plan puts them on another head (`exchange`);
    each head hands its share to its model-parallel peers.

Rank 0 keeps control (what to generate, when to push, eval), not the bytes: a step's replies
arrive spread over the heads. The samples are the ones rank 0 alone would have received (the same
prompts and seeds, the same groups kept, in the same order), so a run trains the same either way
(moe_rl/recipes/rl/batch.py is that path, `rollout.intake=rank0`). A failure on any head (no server
answered, a reward that raised) reaches every head at the next exchange of numbers, and every rank
stops there.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from moe_rl.algo.config import replay_mode, staleness_bound
from moe_rl.algo.filters import dynamic_sampling
from moe_rl.dist.collectives import all_gather_objects, broadcast_object, exchange, heads, to_peers
from moe_rl.recipes.rl.async_rollouts import check_staleness
from moe_rl.recipes.rl.batch import (StepBatch, advantage_metrics, advantages_and_filters, merge_stats,
                                     minibatch_order, score_metrics, scored_stats, staleness_of)
from moe_rl.recipes.rl.replay_health import cover_counts, coverage_of
from moe_rl.recipes.rl.rollouts import request, rollout, to_samples, wait_for_prefetch
from moe_rl.rollout.outage import attempt, failed, unwrap
from moe_rl.samples import Samples, Share, response_mask, share_of, share_plan, usable_groups

log = logging.getLogger(__name__)
COUNTS = ("rollout/stale_resamples", "rollout/dropped_stale_groups")  # the take's metrics that add up over heads


class HeadsIntake:
    """Every data-parallel head a client of the servers for its own block of each step's groups.

    Made on every rank (collective: the heads' group); `draw` and `request` are the ones the
    head's rollout source (`run.rollouts`) uses, so the asynchronous one asks for its block too."""

    def __init__(self, run_rank: int, dp_rank: int, peers: list[int], prompts_per_step: int) -> None:
        self.heads, self.group = heads(dp_rank, peers)
        self.peers = list(peers)
        self.is_head = run_rank == min(peers)
        self.index = [r for _, r in self.heads].index(min(peers))  # this head's place among the heads
        n, count = prompts_per_step, len(self.heads)
        self.block = (self.index * n // count, (self.index + 1) * n // count)  # its groups of each draw
        if run_rank == 0:
            log.info("rollout.intake=heads: %d data-parallel heads (trainer ranks %s) each receive their own "
                     "prompt groups from the servers", count, ", ".join(str(r) for _, r in self.heads))

    def _broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every head (one head: itself; the heads' group is None then, and a
        collective on None would wait for every rank)."""
        return broadcast_object(obj, self.group) if len(self.heads) > 1 else obj

    # ---------------------------------------------------------------- what the head's rollouts ask for

    def draw(self, run: Any) -> list[Any]:
        """This head's block of the next prompts (collective over the heads: rank 0 draws them)."""
        drawn = self._broadcast(run.sampler.next_batch() if run.rank == 0 else None)
        lo, hi = self.block
        return [run.dataset[i] for i in drawn[lo:hi]]

    def request(self, run: Any, prompts: list[Any], step: int, greedy: bool) -> list:
        """The engine's answers for this head's prompts, seeded as their place in the whole draw."""
        return request(run, prompts, step, greedy, offset=self.block[0])

    def pushed(self, run: Any) -> None:
        """After a weight push (collective): each head's client learns the weights the servers now
        serve, so it checks its samples' versions as rank 0's client does."""
        if not self.is_head:
            return
        record = self._broadcast(run.engine.push_record() if run.rank == 0 else None)
        if run.rank != 0:
            run.engine.follow_push(record)

    # ---------------------------------------------------------------- the step's batch

    def batch(self, run: Any, step: int) -> StepBatch:
        """This rank's part of the step (collective: every head receives its groups, plans the step
        with the others and hands its share to its peers)."""
        mine = attempt(lambda: self._head_batch(run, step), run.rank) if self.is_head else None
        return unwrap(to_peers(mine, self.peers))

    def _gather(self, local: Any) -> tuple[Any, list[Any]]:
        """`local` = (what stays here, what every head gets) or a failure: this head's part and every
        head's shared part; a failure on any head raised on every head (its own as itself)."""
        sent = local if failed(local) else local[1]
        parts = all_gather_objects(sent, self.group) if len(self.heads) > 1 else [sent]
        if failed(local):
            unwrap(local)
        for part in parts:
            if failed(part):
                unwrap(part)
        return local[0], parts

    def _scored(self, run: Any, samples: Samples) -> tuple[Samples, dict[str, Any]]:
        return samples, {"stats": scored_stats(run, samples), "failures": run.rewards.failures}

    def _head_batch(self, run: Any, step: int) -> StepBatch:
        a, g = run.cfg.algo, run.cfg.rollout.n_samples

        def received() -> tuple[Samples, dict[str, Any]]:
            samples, staleness, took = rollout(run, step)        # this head's groups (run.rollouts)
            samples, shared = self._scored(run, samples)
            return samples, shared | {"took": took, "staleness": staleness}

        samples, parts = self._gather(attempt(received, run.rank))
        metrics = dict(parts[0]["took"]) | {k: sum(p["took"].get(k, 0.0) for p in parts) for k in COUNTS
                                            if k in parts[0]["took"]}
        stats = merge_stats([p["stats"] for p in parts])
        metrics |= score_metrics(stats, float(sum(p["failures"] for p in parts)))
        metrics |= {"rollout/staleness": float(parts[0]["staleness"])} | staleness_of(stats)
        check_staleness(metrics, staleness_bound(a))
        lo, hi = self.block
        groups = list(range(lo, hi))                                # this head's groups' places in the step
        if a.dynamic_sampling:                                      # DAPO: refill with informative groups
            samples, groups, more = self._refill(run, step, samples, parts)
            metrics |= more
            if samples is None:
                return StepBatch(metrics, None)
        index = [q * g + j for q in groups for j in range(g)]       # each sample's place in the step

        def planned() -> tuple[Samples, dict[str, Any]]:
            kept, _ = advantages_and_filters(run, samples)          # shaping, group advantages: per group, here
            shared = {"index": index, "length": kept.lengths(), "reward": kept.rewards, "adv": kept.advantages}
            if replay_mode(a) == "r3":
                mask = response_mask(kept, max(kept.lengths(), default=1) - 1).bool()
                shared["cover"] = cover_counts(kept, mask, list(run.policy.arch.moe_layers), index)
            return kept, shared

        samples, parts = self._gather(attempt(planned, run.rank))
        metrics |= self._step_metrics(run, parts)
        return StepBatch(metrics, self._share(run, step, samples, index, parts),
                         sum(n for p in parts for n in p["length"]))

    def _refill(self, run: Any, step: int, samples: Samples, parts: list[Any]
                ) -> tuple[Samples | None, list[int], dict[str, float]]:
        """DAPO's rounds over the heads (batch.dynamic_sampling_rounds, with the kept-group counts
        shared): this head's kept samples of the step's first `use` kept groups, and their places."""
        a, g, want = run.cfg.algo, run.cfg.rollout.n_samples, run.cfg.data.prompts_per_step
        informative = lambda s: s.select(dynamic_sampling(s.rewards, group_size=g).keep.tolist())  # noqa: E731
        kept_of = lambda p: int(dynamic_sampling(p["stats"]["reward"].float(), group_size=g).keep.numel()) // g  # noqa: E731
        kept = informative(samples)
        total, places = 0, []                    # kept groups so far (all heads); this head's kept groups' places
        rounds, generated = 0, 0
        while True:
            counts = [kept_of(p) for p in parts]
            places += list(range(total + sum(counts[:self.index]), total + sum(counts[:self.index + 1])))
            total, rounds = total + sum(counts), rounds + 1
            generated += sum(len(p["stats"]["reward"]) for p in parts) // g
            if total >= want or rounds >= a.dynamic_sampling_max_rounds:
                break
            wait_for_prefetch(run)
            more, parts = self._gather(attempt(lambda: self._scored(run, self._generate(run, step)), run.rank))
            kept = kept + informative(more)
        use = usable_groups(min(total, want), g, run.policy.dp_size * a.num_minibatches)
        metrics = {"filter/rounds": float(rounds), "filter/generated_groups": float(generated),
                   "filter/kept_groups": float(use), "filter/dropped_groups": float(generated - use)}
        if use == 0:
            return None, [], metrics | {"filter/skipped_step": 1.0}
        mine = [k for k, q in enumerate(places) if q < use]
        return kept.select([k * g + j for k in mine for j in range(g)]), [places[k] for k in mine], metrics

    def _generate(self, run: Any, step: int) -> Samples:
        prompts = self.draw(run)
        return to_samples(run, prompts, self.request(run, prompts, step, False))

    def _step_metrics(self, run: Any, parts: list[Any]) -> dict[str, float]:
        """The advantages' and R3 coverage's metrics of the whole step, from every head's numbers."""
        g = run.cfg.rollout.n_samples
        order = torch.tensor([i for p in parts for i in p["index"]]).argsort()
        rewards = torch.cat([p["reward"] for p in parts])[order]
        out: dict[str, float] = {}
        if parts[0]["adv"] is not None:
            out |= advantage_metrics(rewards, torch.cat([p["adv"] for p in parts])[order], g)
        if "cover" in parts[0]:
            out |= coverage_of([p["cover"] for p in parts], list(run.policy.arch.moe_layers),
                               run.cfg.algo.replay_min_coverage)
        return out

    def _share(self, run: Any, step: int, samples: Samples, index: list[int], parts: list[Any]) -> Share:
        """This head's share: the same plan as `batch.my_share` on the whole step (every head computes it
        from the shared lengths), its samples fetched from the heads that received them."""
        owner, length = {}, {}                                      # by place in the step (0 .. N - 1)
        for h, p in enumerate(parts):
            for i, n in zip(p["index"], p["length"]):
                owner[i], length[i] = h, n
        lengths = [length[i] for i in range(len(length))]
        plan = {h: share_plan(lengths, run.policy.dp_size, key, run.cfg.algo.num_minibatches,
                              run.policy.packs_sequences, minibatch_order(run, step))
                for h, (key, _) in enumerate(self.heads)}
        here = {i: k for k, i in enumerate(index)}
        outgoing = {}                                               # what this head received for the others
        for h, rows in plan.items():
            ids = [i for m in rows for i in m if owner[i] == self.index]
            if h != self.index and ids:
                outgoing[h] = (ids, samples.select([here[i] for i in ids]))
        pool, ids = samples, list(index)
        for _, (theirs, got) in sorted((exchange(outgoing, self.group) if len(self.heads) > 1 else {}).items()):
            pool, ids = pool + got, ids + theirs
        at = {i: k for k, i in enumerate(ids)}
        return share_of(pool, [[at[i] for i in m] for m in plan[self.index]])
