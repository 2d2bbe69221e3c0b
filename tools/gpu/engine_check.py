"""Engine against trainer on the same tokens, for the GPU check's serving stages (tools/gpu/stages.py).

A rollout engine (`moe-rl serve` or SGLang behind `SGLangClient`, or a `LocalEngine` in this process)
samples responses with `ignore_eos` (so every sample decodes exactly `new_tokens` tokens) and returns
their log-probs and routed experts; the megatron policy of this process scores the same tokens twice:
with its own routes (recorded) and replaying the engine's (R3). Reported:

- route mismatch (1 - |S_engine ∩ S_trainer| / k, mean over tokens and layers, `moe_rl.drift.metrics`)
  on the prompt's rows (prefill) and the decoded tokens' rows (each decode step's routes) apart;
- |Δ log p| between engine and trainer on the sampled tokens, under R3 and under the trainer's own
  routes (`logprob_mismatch`: mean, k3 KL, share with p_train / p_engine outside [1/2, 2]) and its max.

One trainer rank (world size 1), on the GPU when there is one; the server on the same GPU.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from moe_rl.drift.metrics import logprob_mismatch, route_stats
from moe_rl.rollout.engine import GenerateRequest, GenerateResult, SamplingParams

BENCH = Path(__file__).resolve().parents[1] / "bench"  # tools/bench: common.token_loss


def one_rank() -> None:
    """This process as rank 0 of a world of 1 (nccl on GPU, gloo on CPU) with megatron's groups."""
    from moe_rl.dist.ports import free_port
    from moe_rl.dist.spawn import set_local_rank_env
    from moe_rl.policy.parallel import ParallelLayout, init_distributed

    if "RANK" not in os.environ:
        set_local_rank_env(0, 1, free_port())
    init_distributed(ParallelLayout())


def build_policy(hf_dir: str | Path, lr: float = 1e-2, micro_batch_size: int = 8) -> Any:
    """The fp32 megatron policy of `hf_dir` on one rank; padded micro-batches (transformer-engine has
    no fp32 packed attention). `lr` large enough that one Adam step visibly changes every log-prob."""
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig

    return Policy(PolicySpec(str(hf_dir), ParallelLayout(), OptimConfig(lr=lr), dtype="fp32",
                             micro_batch_size=micro_batch_size))


def launch(engine: str, hf_dir: str | Path, log_dir: str | Path, mem_fraction: float = 0.3) -> Any:
    """One server of `engine` ("local": `moe-rl serve`, "sglang") on this machine's GPU 0 (the
    trainer's: `mem_fraction` of it for SGLang), or on the CPU without one; started, not yet healthy."""
    from moe_rl.rollout.config import RolloutConfig
    from moe_rl.rollout.launcher import ServerGroup

    cfg = RolloutConfig(engine=engine, num_servers=1, mem_fraction=mem_fraction)
    gpus = [0] if torch.cuda.is_available() else [None]
    return ServerGroup.from_config(cfg, hf_dir, log_dir, gpus=gpus).start()


def client(group: Any) -> Any:
    """An `SGLangClient` on the group's servers (a new one per weight sync: it tracks the versions
    it pushed itself, and a push over the update group it did not make would look stale to it)."""
    from moe_rl.rollout.sglang_client import SGLangClient

    return SGLangClient(group.urls, admin_urls=group.admin_urls, request_timeout=120.0)


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` random prompts of `length` ids in [3, vocab) (0-2: pad, bos, eos of the tiny models)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def generate(engine: Any, prompt_ids: Sequence[Sequence[int]], new_tokens: int, seed: int = 0) -> list[GenerateResult]:
    """One sample per prompt at temperature 1, exactly `new_tokens` decoded (ignore_eos), with its
    log-probs and routed experts."""
    reqs = [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True,
                                              seed=seed + i), return_routed_experts=True)
            for i, p in enumerate(prompt_ids)]
    results = [r[0] for r in engine.generate(reqs)]
    short = [len(r.output_ids) for r in results if len(r.output_ids) != new_tokens]
    if short:
        raise RuntimeError(f"the engine decoded {short} tokens, asked for {new_tokens} with ignore_eos")
    if any(r.routed_experts is None for r in results):
        raise RuntimeError("the engine returned no routed_experts (SGLang: --enable-return-routed-experts)")
    return results


def compare(policy: Any, results: list[GenerateResult]) -> dict[str, float]:
    """Routes and log-probs of the engine's samples (one prompt length, `generate`'s) vs the trainer's."""
    p = len(results[0].prompt_ids)
    seqs = [torch.tensor(r.token_ids) for r in results]
    engine_routes = torch.from_numpy(np.stack([np.asarray(r.routed_experts) for r in results]))  # [B, T-1, L, K]
    engine_logp = torch.from_numpy(np.stack([r.output_logprobs for r in results])).double()    # [B, N]
    free = policy.logprobs(seqs, record_routes=True)
    replayed = policy.logprobs(seqs, replay_routes=engine_routes)
    trainer_routes = free.routes.cpu()
    L, K = engine_routes.shape[2:]
    out: dict[str, float] = {"samples": float(len(results)), "decoded_tokens": float(len(results[0].output_ids))}
    # Row t routes token t. The prompt's rows come from the prefill (its last one also samples the first
    # output token); rows p .. T-2 from the decode steps that fed the output tokens back in.
    for name, rows in (("prefill", slice(0, p)), ("decode", slice(p, None))):
        stats = route_stats(engine_routes[:, rows].reshape(-1, L, K), trainer_routes[:, rows].reshape(-1, L, K))
        s = stats.summary("m")
        out[f"route_mismatch_{name}"] = s["m"]
        out[f"route_exact_match_{name}"] = s["m/exact_match"]
    for name, lp in (("r3", replayed.logp), ("free", free.logp)):
        trainer = lp.cpu().double()[:, p - 1:]  # logp[:, t] scores token t + 1: the outputs start at p - 1
        s = logprob_mismatch(trainer, engine_logp).summary(f"logp_{name}")
        out[f"logp_abs_diff_{name}"] = s[f"logp_{name}_abs_diff"]
        out[f"logp_k3_{name}"] = s[f"logp_{name}_k3"]
        out[f"logp_ratio_outside_{name}"] = s[f"logp_{name}_ratio_outside"]
        out[f"logp_abs_max_{name}"] = float((trainer - engine_logp).abs().max())
    return out


def judge(figures: dict[str, float], logp_limit: float, route_limit: float) -> list[str]:
    """What breaks the bounds: R3 log-probs within `logp_limit` (mean |Δ|) with no token's probability
    off by 2x, and the decode steps' routes within `route_limit` of the trainer's own."""
    problems = []
    if not figures["logp_abs_diff_r3"] <= logp_limit:
        problems.append(f"R3 engine vs trainer mean |d log p| {figures['logp_abs_diff_r3']:.3g} > {logp_limit:g}")
    if figures["logp_ratio_outside_r3"] > 0:
        problems.append(f"{figures['logp_ratio_outside_r3']:.3g} of the tokens have p_train / p_engine "
                        "outside [1/2, 2]")
    if not figures["route_mismatch_decode"] <= route_limit:
        problems.append(f"decode route mismatch {figures['route_mismatch_decode']:.3g} > {route_limit:g}")
    return problems


def update_step(policy: Any, seqs: list[torch.Tensor]) -> None:
    """One optimizer step of the policy on the mean negative log-likelihood of `seqs`."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import common  # tools/bench/common.py: the benchmarks' token loss

    policy.update(seqs, {}, common.token_loss(sum(len(s) - 1 for s in seqs)))
