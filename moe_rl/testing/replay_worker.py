"""Per-rank checks of routing replay, run by the distributed tests through `run_ranks`.

Lives in the package (not the test module) because spawned ranks import it by name.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch


def _perturb_routers(chunks: list[Any], scale: float, seed: int) -> None:
    """Add the same noise to every router weight on every rank (routers are replicated)."""
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if name.endswith("mlp.router.weight"):
                layer = chunk.decoder.layers[int(name.split(".")[2])].layer_number
                g = torch.Generator().manual_seed(seed * 1000 + layer)
                with torch.no_grad():
                    p.add_(torch.randn(p.shape, generator=g) * scale)


def replay_worker(layout_name: str, hf_dir: str, sequences: list[torch.Tensor], micro_batch_size: int = 2,
                  recompute: bool = False, engine_routes: list[torch.Tensor] | None = None,
                  pack_tokens: int | None = None) -> dict[str, Any]:
    """Record, replay, perturb, replay again; optionally replay engine routes (R3) and train under replay.

    `pack_tokens`: also record and replay with sequences packed into rows of that many tokens.
    """
    from moe_rl.policy.convert import load_hf_weights
    from moe_rl.policy.forward import compute_logprobs, make_microbatches, token_logprobs
    from moe_rl.policy.model import build_model, read_hf_config
    from moe_rl.policy.parallel import ParallelLayout, data_parallel_rank_and_size, init_distributed
    from moe_rl.policy.replay import RouteReplay
    from moe_rl.policy.train_step import OptimConfig, PolicyOptimizer

    layout = ParallelLayout.parse(layout_name)
    arch = read_hf_config(hf_dir)
    init_distributed(layout.validate(arch))
    chunks = build_model(arch, layout, recompute=recompute)
    load_hf_weights(chunks, hf_dir, arch)
    dp_rank, dp = data_parallel_rank_and_size()
    index = list(range(dp_rank, len(sequences), dp))
    mine = [sequences[i] for i in index]
    rr = RouteReplay(chunks, arch)

    def replay_and_observe(routes):
        @contextmanager
        def ctx(mbs):
            with rr.replay(routes, mbs), rr.observe(mbs) as seen:
                yield seen
        return ctx

    out: dict[str, Any] = {"index": index}
    recorded = compute_logprobs(chunks, mine, micro_batch_size, routing=lambda m: rr.record(m, confidence=True))
    out["recorded_routes"], out["route_confidence"] = recorded.routes, recorded.route_confidence
    out["logp_record"] = recorded.logp
    out["logp_replay"] = compute_logprobs(chunks, mine, micro_batch_size,
                                          routing=replay_and_observe(recorded.routes)).logp
    if pack_tokens:  # the same, several sequences to a packed row
        packed = compute_logprobs(chunks, mine, micro_batch_size, routing=rr.record, max_tokens=pack_tokens)
        out["logp_record_packed"], out["recorded_routes_packed"] = packed.logp, packed.routes
    _perturb_routers(chunks, scale=0.5, seed=7)
    free = compute_logprobs(chunks, mine, micro_batch_size, routing=rr.observe)
    out["logp_free_perturbed"], out["routes_free_perturbed"] = free.logp, free.routes
    replayed = compute_logprobs(chunks, mine, micro_batch_size, routing=replay_and_observe(recorded.routes))
    out["logp_replay_perturbed"], out["routes_used_perturbed"] = replayed.logp, replayed.routes
    if pack_tokens:
        replayed = compute_logprobs(chunks, mine, micro_batch_size, routing=replay_and_observe(recorded.routes),
                                    max_tokens=pack_tokens)
        out["logp_replay_perturbed_packed"], out["routes_used_perturbed_packed"] = replayed.logp, replayed.routes

    # Updates under replay: forward + backward (recompute replays the same targets).
    opt = PolicyOptimizer(chunks, OptimConfig())
    from moe_rl.policy.parallel import ParallelLayout as _PL  # noqa: F401  (keeps imports local)

    tp = layout.tp
    mbs = make_microbatches(mine, micro_batch_size, pad_multiple=tp,
                            seq_len=max(len(s) for s in sequences))

    def loss_fn(logits, mb):
        logp = token_logprobs(logits, mb.tokens)
        return -(logp * mb.loss_mask).sum() / 100.0, {}

    opt.backward(mbs, loss_fn, routing=lambda m: rr.replay(recorded.routes, m))
    out["grad_norm_sq"] = sum(float(p.main_grad.float().pow(2).sum()) for c in opt.chunks for p in c.parameters()
                              if getattr(p, "main_grad", None) is not None)

    if engine_routes is not None:
        width = max(len(s) for s in mine) - 1
        r3 = torch.stack([torch.nn.functional.pad(engine_routes[i].long(),
                                                  (0, 0, 0, 0, 0, width - engine_routes[i].shape[0]))
                          for i in index])
        out["routes_used_r3"] = compute_logprobs(chunks, mine, micro_batch_size,
                                                 routing=replay_and_observe(r3)).routes
    return out


def bad_routes_worker(hf_dir: str, sequences: list[torch.Tensor]) -> dict[str, str]:
    """Feed malformed routes and return each error message."""
    from moe_rl.policy.convert import load_hf_weights
    from moe_rl.policy.forward import compute_logprobs
    from moe_rl.policy.model import build_model, read_hf_config
    from moe_rl.policy.parallel import ParallelLayout, init_distributed
    from moe_rl.policy.replay import RouteReplay

    arch = read_hf_config(hf_dir)
    init_distributed(ParallelLayout())
    chunks = build_model(arch, ParallelLayout())
    load_hf_weights(chunks, hf_dir, arch)
    rr = RouteReplay(chunks, arch)
    good = compute_logprobs(chunks, sequences, 2, routing=rr.record).routes
    cases = {
        "short": good[:, :-3],
        "missing_layer": good[:, :, :-1],
        "bad_id": torch.where(good == good[0, 0, 0, 0], torch.tensor(arch.num_moe_experts, dtype=good.dtype), good),
        "wrong_batch": good[:-1],
    }
    errors = {}
    for name, routes in cases.items():
        try:
            compute_logprobs(chunks, sequences, 2, routing=lambda m, r=routes: rr.replay(r, m))
            errors[name] = ""
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    # A schedule that runs fewer microbatches than targets were given leaves targets unconsumed.
    try:
        from moe_rl.policy.forward import make_microbatches, run_schedule

        mbs = make_microbatches(sequences, 2)
        with rr.replay(good, mbs):
            run_schedule(chunks, mbs[:1], lambda logits, mb: (logits.sum() * 0, {}), forward_only=True)
        errors["unconsumed"] = ""
    except Exception as exc:
        errors["unconsumed"] = f"{type(exc).__name__}: {exc}"
    return errors
