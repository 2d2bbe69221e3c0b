"""One DPO step, top to bottom, and the DPO run the trainer builds (train.mode=dpo).

    preference pairs (data/preference.py) -> this DP rank's pairs (chosen, rejected adjacent)
      -> summed response log-probs under the policy (policy/forward.py)
      -> dpo_loss against the cached reference log-probs (algo/losses.py)
      -> backward -> optimizer step (policy/train_step.py) -> expert drift on a probe set (drift/)

There is no rollout engine and no weight sync. The reference log-probs are computed
once, before training, by the initial policy (or `dpo.ref_path` loaded into the same
model for one pass), and cached in the run directory keyed by a hash of the pairs and
of the reference checkpoint; a resumed run reuses them, so no second model is held.
Every function runs on every trainer rank.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moe_rl.algo.losses import dpo_loss
from moe_rl.config import RunConfig
from moe_rl.data.preference import PreferenceDataset, PreferencePair, load_preference_dataset
from moe_rl.data.sampler import PromptSampler
from moe_rl.dist.collectives import broadcast_object as broadcast, rank
from moe_rl.policy.policy import Policy
from moe_rl.recipes.build import run_tokenizer, initial_model, make_policy
from moe_rl.recipes.common import Stopwatch, all_keys, probe_volatility
from moe_rl.samples import share_indices

log = logging.getLogger(__name__)

REF_CACHE = "ref_logps.pt"
REF_CHUNK = 256  # pairs per reference / eval pass on each rank: bounds the [B, T] log-prob buffers


@dataclass
class DPORun:
    """Everything a DPO step needs, built once (`moe_rl.recipes.DPORecipe` runs it)."""

    cfg: RunConfig
    policy: Policy
    train: PreferenceDataset
    eval: PreferenceDataset | None
    ref_train: torch.Tensor        # [N, 2] reference log-probs of (chosen, rejected) per train pair
    ref_eval: torch.Tensor | None  # [M, 2] the same for the eval pairs
    sampler: PromptSampler         # over train pairs
    rank: int = 0
    weight_version: int = 0
    drift_state: dict[str, Any] = field(default_factory=dict)


def dpo_step(run: DPORun, step: int) -> dict[str, float]:
    """One DPO step; returns the step's metrics (identical on every rank)."""
    clock = Stopwatch()
    batch = run.sampler.next_batch()                                   # every rank draws the same pairs
    if "probe_routes" not in run.drift_state and run.cfg.drift.enabled:
        probe_drift(run)                                               # routes before the first update
    mine = share_indices([len(run.train[i]) for i in batch], run.policy.dp_size, run.policy.dp_rank, 1,
                         by_tokens=run.policy.packs_sequences)[0]      # this DP rank's pairs
    metrics = update(run, [batch[i] for i in mine], len(batch))        # log-probs -> dpo_loss -> optimizer step
    clock.lap("update")
    run.weight_version += 1
    if run.cfg.drift.enabled and step % run.cfg.drift.probe_every == 0:
        metrics |= probe_drift(run)                                    # expert volatility since the last probe
    clock.lap("drift")
    tokens = sum(len(run.train[i]) for i in batch)
    return metrics | clock.metrics() | {"perf/tokens_per_s": tokens / clock.total(),
                                        "perf/weight_version": float(run.weight_version)}


# ---------------------------------------------------------------- the update

def pair_batch(pairs: list[PreferencePair], ref: torch.Tensor) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Sequences `[c_0, r_0, c_1, r_1, ...]` and the loss's extras: `resp` `[2B, T - 1]` (1 where a
    position predicts a response token) and `ref` `[2B]` (reference log-probs in the same order)."""
    seqs = [s for p in pairs for s in p.sequences()]
    prompt_lens = torch.tensor([len(p.prompt_ids) for p in pairs]).repeat_interleave(2)
    return seqs, {"resp": response_mask(prompt_lens, torch.tensor([len(s) for s in seqs])),
                  "ref": ref.reshape(-1).float()}


def response_mask(prompt_lens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`[B, max(lengths) - 1]`: 1 where position t predicts a response token (P - 1 <= t < T - 1)."""
    t = torch.arange(int(lengths.max()) - 1).view(1, -1)
    return ((t >= prompt_lens.view(-1, 1) - 1) & (t < lengths.view(-1, 1) - 1)).float()


def update(run: DPORun, mine: list[int], num_pairs: int) -> dict[str, float]:
    """One optimizer step on this rank's pairs (`mine`: train indices); the loss is normalised by
    the step's `num_pairs` over all ranks, so any split gives the same gradient."""
    seqs, extras = pair_batch([run.train[i] for i in mine], run.ref_train[mine])
    out = run.policy.update(seqs, extras, pair_loss(run.cfg, num_pairs), group_size=2)
    return combine(run.policy, out.microbatches) | out.step


def pair_loss(cfg: RunConfig, num_pairs: float):
    """The `PolicyLoss` of a micro-batch whose rows are (chosen, rejected) pairs."""
    d = cfg.dpo

    def loss(logp: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, float]]:
        resp = mb.extras["resp"]
        sums = (logp * resp).sum(1)  # [2b] summed response log-probs
        ref = mb.extras["ref"]
        return dpo_loss(sums[0::2], sums[1::2], ref[0::2], ref[1::2], beta=d.beta, label_smoothing=d.label_smoothing,
                        kind=d.loss, sft_coef=d.sft_coef, chosen_len=resp[0::2].sum(1),
                        weight=(mb.index[0::2] >= 0).float(), num_pairs=num_pairs)
    return loss


def combine(policy: Policy, microbatches: list[dict[str, float]]) -> dict[str, float]:
    """Loss metrics over all micro-batches and ranks: `loss/dpo` adds up (it is globally normalised),
    the rest are means weighted by `dpo/num_pairs`. Collective over all ranks."""
    rows = microbatches if policy.reports_loss else []  # earlier pipeline stages and TP copies: nothing
    keys = [k for k in all_keys({k for r in rows for k in r}) if k not in ("loss/dpo", "dpo/num_pairs")]
    sums = [sum(r["loss/dpo"] for r in rows), sum(r["dpo/num_pairs"] for r in rows)]
    sums += [sum(r[k] * r["dpo/num_pairs"] for r in rows) for k in keys]
    total = policy.all_reduce_sum(torch.tensor(sums, dtype=torch.float64), group="world").tolist()
    return {"loss/dpo": total[0], "dpo/num_pairs": total[1]} | {k: v / max(total[1], 1.0)
                                                               for k, v in zip(keys, total[2:])}


# ---------------------------------------------------------------- summed log-probs, reference, eval

def pair_logps(policy: Policy, pairs: list[PreferencePair]) -> torch.Tensor:
    """`[N, 2]` summed response log-probs of (chosen, rejected) for every pair, on every rank.

    The pairs are split over data-parallel ranks (equal counts, the last pair repeated to fill)
    and the results summed over them.
    """
    dp, rank = policy.dp_size, policy.dp_rank
    out = torch.zeros(len(pairs), 2, dtype=torch.float64)
    per = -(-len(pairs) // dp)
    for start in range(0, per, REF_CHUNK):
        idx = [min(rank * per + j, len(pairs) - 1) for j in range(start, min(start + REF_CHUNK, per))]
        owned = [rank * per + j < len(pairs) for j in range(start, min(start + REF_CHUNK, per))]
        seqs, extras = pair_batch([pairs[i] for i in idx], torch.zeros(len(idx), 2))
        resp = extras["resp"]
        lp = policy.logprobs(seqs).logp[:, : resp.shape[1]]  # wider when padded for TP or other ranks
        sums = (lp * resp).sum(1).double().view(-1, 2)
        keep = torch.tensor(owned)
        out[torch.tensor(idx)[keep]] = sums[keep]
    return policy.all_reduce_sum(out)


def reference_logps(cfg: RunConfig, policy: Policy, out: Path, hf_dir: Path, train: PreferenceDataset,
                    evals: PreferenceDataset | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(train `[N, 2]`, eval `[M, 2]` or None) reference log-probs: the run directory's cache when its
    key matches the pairs and the reference checkpoint, else one pass of the reference (and cache it)."""
    ref_dir = Path(cfg.dpo.ref_path) if cfg.dpo.ref_path else hf_dir
    if not (ref_dir / "config.json").is_file():
        raise FileNotFoundError(f"dpo.ref_path: {ref_dir} has no config.json; give a HF checkpoint directory "
                                "of the policy's architecture, or null for the initial policy")
    pairs = list(train) + (list(evals) if evals is not None else [])
    key = broadcast(cache_key(pairs, ref_dir) if rank() == 0 else None)
    path = out / REF_CACHE
    cached = torch.load(path, weights_only=True) if path.is_file() else None
    if cached is not None and cached.get("key") == key:
        logps = cached["logps"]
        log.info("reference log-probs of %d pairs: read from %s", len(pairs), path)
    else:
        start = time.monotonic()
        if cfg.dpo.ref_path:
            policy.load_hf_weights(ref_dir)
        logps = pair_logps(policy, pairs).float()
        if cfg.dpo.ref_path:
            policy.load_hf_weights(hf_dir)  # the policy's own start again
        if rank() == 0:
            torch.save({"key": key, "logps": logps}, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
        log.info("reference log-probs of %d pairs: computed by %s in %.1f s, cached in %s", len(pairs), ref_dir,
                 time.monotonic() - start, path)
    return logps[: len(train)], (logps[len(train):] if evals is not None else None)


def cache_key(pairs: list[PreferencePair], ref_dir: Path) -> str:
    """sha256 of the pairs' token ids and of the reference checkpoint (file names, sizes, and
    contents of files under 64 MiB; modification times of larger weight shards, not their bytes)."""
    h = hashlib.sha256()
    for p in pairs:
        h.update(repr((p.prompt_ids, p.chosen_ids, p.rejected_ids)).encode())
    for f in sorted(x for x in ref_dir.iterdir() if x.is_file()):
        stat = f.stat()
        h.update(f"{f.name}:{stat.st_size}".encode())
        h.update(f.read_bytes() if stat.st_size < 64 << 20 else str(stat.st_mtime_ns).encode())
    return h.hexdigest()


def evaluate(run: DPORun, dataset: PreferenceDataset, step: int) -> dict[str, float]:
    """Reward accuracy, margin and loss on the held-out pairs (`dataset` is `run.eval`)."""
    assert run.ref_eval is not None and len(run.ref_eval) == len(dataset)
    lp = pair_logps(run.policy, list(dataset))
    d = run.cfg.dpo
    loss, m = dpo_loss(lp[:, 0], lp[:, 1], run.ref_eval[:, 0].double(), run.ref_eval[:, 1].double(), beta=d.beta,
                       label_smoothing=d.label_smoothing, kind=d.loss)
    return {"eval/reward_accuracy": m["dpo/reward_accuracy"], "eval/reward_margin": m["dpo/reward_margin"],
            "eval/loss": float(loss)}


# ---------------------------------------------------------------- drift

def probe_drift(run: DPORun) -> dict[str, float]:
    """Expert volatility on a fixed probe set (the first train pairs, split over DP ranks) since the
    last probe, per MoE layer (`drift/probe_volatility/layer_NN`)."""
    state = run.drift_state
    if "probe" not in state:
        dp = run.policy.dp_size  # pairs: a multiple of dp, so padded micro-batches get equal counts
        n = min(max(dp, run.cfg.drift.probe_size // 2 // dp * dp), len(run.train) // dp * dp)
        state["probe"] = [s for i in range(run.policy.dp_rank, n, dp) for s in run.train[i].sequences()]
    return probe_volatility(run.policy, state)


# ---------------------------------------------------------------- building the run

def build_dpo_run(cfg: RunConfig, out: Path, rank: int) -> DPORun:
    """Preference data, the policy, the reference log-probs: what `trainer.train_rank` runs."""
    d = cfg.dpo
    tokenizer = run_tokenizer(cfg)
    train = load_preference_dataset(cfg.data.train, tokenizer, d.max_len)
    evals = (load_preference_dataset(cfg.data.eval, tokenizer, d.max_len)
             if cfg.data.eval and cfg.train.eval_every else None)
    hf_dir = initial_model(cfg, out, rank, train)
    policy = make_policy(cfg, hf_dir, updates_per_step=1)
    ref_train, ref_eval = reference_logps(cfg, policy, out, hf_dir, train, evals)
    sampler = PromptSampler(len(train), d.pairs_per_step, seed=cfg.data.shuffle_seed)
    run = DPORun(cfg=cfg, policy=policy, train=train, eval=evals, ref_train=ref_train, ref_eval=ref_eval,
                 sampler=sampler, rank=rank)
    return run
