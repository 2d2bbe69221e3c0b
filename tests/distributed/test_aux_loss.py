"""The MoE router's auxiliary load-balancing loss is normalised as megatron intends.

Under `calculate_per_token_loss` megatron scales each micro-batch's aux loss by the
router's token count and leaves the division to `finalize_model_grads(..., num_tokens)`.
With a zero policy loss only the aux term drives the routers' gradients, which must
then be the mean of the micro-batches' aux gradients: unchanged when the batch is
duplicated, when it is split into micro-batches differently, over DP ranks or TP
ranks, and for a single micro-batch equal to megatron's own aux-loss gradient
(computed here without per-token scaling, on the bare model). The policy gradient
stays what it was: compared with HF transformers' autograd on the same loss.

Tolerances: relative error of each router gradient (norm of the difference over the
norm of the reference) ≤ 1e-5 in one process, ≤ 1e-4 across layouts and against HF
(fp32; reductions run in another order).
"""
from __future__ import annotations

import pytest
import torch

from moe_rl.policy.parity import layout_worker, sample_sequences, token_weights
from moe_rl.testing import TinyMoEConfig, make_tiny_qwen3_moe, run_ranks

AUX_COEF = 0.1
PACK_TOKENS = 24

# Run name -> (sequence indices of each DP rank, micro_batch_size). One process start
# runs them all; every row is padded to the longest sequence, so micro-batches agree.
SINGLE_RUNS = {
    "a": ([[0]], 1), "b": ([[1]], 1), "c": ([[2]], 1), "d": ([[3]], 1),
    "ab": ([[0, 1]], 2), "cd": ([[2, 3]], 2),
    "abab/2": ([[0, 1, 0, 1]], 2), "abab/4": ([[0, 1, 0, 1]], 4),
    "aaaa/1": ([[0, 0, 0, 0]], 1), "aaaa/2": ([[0, 0, 0, 0]], 2), "aaaa/4": ([[0, 0, 0, 0]], 4),
    "abcd/1": ([[0, 1, 2, 3]], 1), "abcd/2": ([[0, 1, 2, 3]], 2),
}
DP2_RUNS = {"ab|cd": ([[0, 1], [2, 3]], 2), "ab|ab": ([[0, 1], [0, 1]], 2)}
TP2_RUNS = {"ab": ([[0, 1]], 2)}
REFERENCE_RUNS = ("a", "ab")  # one micro-batch each: megatron's own aux gradient


@pytest.fixture(scope="module")
def aux_hf_dir(tmp_path_factory):
    """The tiny Qwen3-MoE with a non-zero `router_aux_loss_coef`."""
    cfg = TinyMoEConfig(router_aux_loss_coef=AUX_COEF)
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_moe_aux"), seed=0, config=cfg)


@pytest.fixture(scope="module")
def sequences():
    """Four sequences, the first the longest (12 tokens, even for TP2's sequence split).

    Token 0, the pad id, is an input in some of them: its embedding row is zero in a
    HF-initialised model and HF never trains it (`padding_idx`); the policy leaves it
    out the same way (`moe_rl.policy.train_step.frozen_rows`).
    """
    seqs = sample_sequences(vocab_size=128, num=4, max_len=12, seed=3)
    seqs[1][2] = seqs[2][1] = 0
    return seqs


@pytest.fixture(scope="module")
def single(aux_hf_dir, sequences):
    (res,) = run_ranks(aux_worker, 1, "single", str(aux_hf_dir), sequences, SINGLE_RUNS, REFERENCE_RUNS)
    return res


def aux_worker(layout_name: str, hf_dir: str, sequences: list[torch.Tensor],
               runs: dict[str, tuple[list[list[int]], int]],
               reference_runs: tuple[str, ...] = ()) -> dict[str, dict[str, torch.Tensor]]:
    """Router-weight gradients `{run: {name: [E, h]}}` of a zero policy loss, through PolicyOptimizer.

    `reference_runs` (one micro-batch each) also get megatron's plain aux gradient
    under the key "<run>:reference".
    """
    from moe_rl.policy.convert import load_hf_weights
    from moe_rl.policy.forward import build_microbatches, microbatch_logprobs
    from moe_rl.policy.model import build_model, read_hf_config
    from moe_rl.policy.parallel import ParallelLayout, data_parallel_rank_and_size, init_distributed
    from moe_rl.policy.train_step import OptimConfig, PolicyOptimizer

    layout = ParallelLayout.parse(layout_name)
    arch = read_hf_config(hf_dir)
    init_distributed(layout.validate(arch))
    chunks = build_model(arch, layout)
    load_hf_weights(chunks, hf_dir, arch)
    opt = PolicyOptimizer(chunks, OptimConfig())
    dp_rank, _ = data_parallel_rank_and_size()
    seq_len = max(len(s) for s in sequences)

    def zero_loss(logits, mb):
        # Keeps the graph (and so megatron's aux-loss backward) without a policy gradient.
        return 0.0 * microbatch_logprobs(logits, mb).sum(), {}

    out = {}
    for name, (rows, micro_batch_size) in runs.items():
        mbs = build_microbatches([sequences[i] for i in rows[dp_rank]], micro_batch_size, seq_len=seq_len)
        opt.backward(mbs, zero_loss)
        out[name] = _router_grads(opt)
        if name in reference_runs:
            assert len(mbs) == 1, name
            out[f"{name}:reference"] = _megatron_aux_grads(opt, mbs[0])
    return out


def _router_grads(opt) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for c in opt.bare_chunks for n, p in c.named_parameters()
            if n.endswith("router.weight")}


def _megatron_aux_grads(opt, mb) -> dict[str, torch.Tensor]:
    """d(coef * sum of the layers' aux losses)/d(router weights) for one micro-batch, by megatron.

    The bare model's forward attaches the aux loss; with the routers' per-token scaling
    off and the aux scale at 1, its backward is exactly the aux loss gradient (no
    schedule, no finalize_model_grads, no token counts).
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for c in opt.bare_chunks for m in c.modules() if isinstance(m, TopKRouter)]
    for r in routers:
        r.calculate_per_token_loss = False
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    for c in opt.chunks:
        c.zero_grad_buffer()
    pos = torch.arange(mb.tokens.shape[1]).unsqueeze(0).expand_as(mb.tokens)
    logits = opt.bare_chunks[0](mb.tokens, pos, attention_mask=None)
    (0.0 * logits.sum()).backward()
    for r in routers:
        r.calculate_per_token_loss = True
    return _router_grads(opt)


def _rel_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(ref) and ref
    return max(float((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)) for n in ref)


def _ratio(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Gradient norm ratio over all routers (shown when a check fails: 2.0 means doubled)."""
    return float(torch.stack([g.norm() for g in got.values()]).norm()
                 / torch.stack([g.norm() for g in ref.values()]).norm())


def _mean(runs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {n: sum(r[n] for r in runs) / len(runs) for n in runs[0]}


def _assert_close(got, ref, tol: float, what: str) -> None:
    err = _rel_err(got, ref)
    assert err <= tol, f"{what}: relative error {err:.2e}, norm ratio {_ratio(got, ref):.4f}"


def test_aux_gradient_is_megatrons_aux_loss_gradient(single):
    """One micro-batch: the router gradient is d(coef * aux)/dW, not that times the token count."""
    for name in REFERENCE_RUNS:
        assert _ratio(single[f"{name}:reference"], single[name]) > 0  # aux gradients are non-zero
        _assert_close(single[name], single[f"{name}:reference"], 1e-5, name)


def test_aux_gradient_unchanged_by_duplicating_the_batch(single):
    _assert_close(single["abab/2"], single["ab"], 1e-5, "batch twice, two micro-batches")
    _assert_close(single["abab/4"], single["ab"], 1e-5, "batch twice, one micro-batch")
    _assert_close(single["aaaa/1"], single["a"], 1e-5, "one sequence four times")


def test_aux_gradient_is_the_mean_over_micro_batches(single):
    for size in (1, 2, 4):  # the same micro-batches' content, split three ways
        _assert_close(single[f"aaaa/{size}"], single["a"], 1e-5, f"micro_batch_size {size}")
    _assert_close(single["abcd/1"], _mean([single[k] for k in "abcd"]), 1e-5, "micro_batch_size 1")
    _assert_close(single["abcd/2"], _mean([single["ab"], single["cd"]]), 1e-5, "micro_batch_size 2")


@pytest.mark.slow
def test_aux_gradient_independent_of_dp_and_tp(aux_hf_dir, sequences, single):
    dp = run_ranks(aux_worker, 2, "dp2", str(aux_hf_dir), sequences, DP2_RUNS)
    for r in dp:
        _assert_close(r["ab|cd"], single["abcd/2"], 1e-4, "DP2, the batch split over ranks")
        _assert_close(r["ab|ab"], single["ab"], 1e-4, "DP2, each rank the same batch")
    tp = run_ranks(aux_worker, 2, "tp2", str(aux_hf_dir), sequences, TP2_RUNS)
    for r in tp:
        _assert_close(r["ab"], single["ab"], 1e-4, "TP2 with sequence parallelism")


def _hf_policy_grads(hf_dir, sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF transformers' gradient of -sum(w * logp) / N (the parity loss), one sequence at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    weights = token_weights(sequences)
    total = sum(len(w) for w in weights)
    for seq, w in zip(sequences, weights):
        logits = model(seq.unsqueeze(0)).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, seq[1:, None]).squeeze(-1)
        (-(logp * w).sum() / total).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
def test_policy_gradient_without_aux_matches_hf(tiny_hf_dir, sequences):
    """Aux coefficient 0: DP2 gradients of the policy loss, padded and packed, equal HF's autograd.

    HF fuses each layer's experts into one tensor, so expert weights are left out; every
    other tensor (embeddings, attention, norms, routers, output layer) is compared.
    """
    results = run_ranks(layout_worker, 2, "dp2", str(tiny_hf_dir), sequences, grads=True,
                        pack_tokens=PACK_TOKENS)
    ref = _hf_policy_grads(tiny_hf_dir, sequences)
    for key in ("grads", "grads_packed"):
        got = {n: g for r in results for n, g in r[key].items() if n in ref}
        assert len(got) >= len(ref) - 2 * 4, sorted(set(ref) - set(got))  # at most the fused experts missing
        for n, g in got.items():
            err = float((g - ref[n]).norm() / ref[n].norm().clamp_min(1e-12))
            assert err <= 1e-4, f"{key}: {n} relative gradient error {err:.2e}"


def override_worker(hf_dir: str, sequences: list[torch.Tensor], coef: float | None) -> dict[str, torch.Tensor]:
    """Router gradients of a zero policy loss through `Policy`, with `model.moe_aux_loss_coef` = `coef`."""
    from moe_rl.policy.forward import build_microbatches, microbatch_logprobs
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig

    policy = Policy(PolicySpec(hf_dir, ParallelLayout(), OptimConfig(), micro_batch_size=2, moe_aux_loss_coef=coef))
    mbs = build_microbatches(sequences[:2], 2, seq_len=max(len(s) for s in sequences))
    policy.opt.backward(mbs, lambda logits, mb: (0.0 * microbatch_logprobs(logits, mb).sum(), {}))
    return _router_grads(policy.opt)


def test_aux_loss_coef_override_replaces_the_checkpoints(tiny_hf_dir, aux_hf_dir, sequences, single):
    """`model.moe_aux_loss_coef`: the same weights with coefficient 0 in their config and the
    override give the checkpoint-with-coefficient's router gradients; 0 turns the loss off."""
    import json

    assert json.loads((tiny_hf_dir / "config.json").read_text())["router_aux_loss_coef"] == 0.0
    (on,) = run_ranks(override_worker, 1, str(tiny_hf_dir), sequences, AUX_COEF)
    _assert_close(on, single["ab"], 1e-5, "override on a checkpoint without aux loss")
    (off,) = run_ranks(override_worker, 1, str(aux_hf_dir), sequences, 0.0)
    assert max(float(g.abs().max()) for g in off.values()) == 0.0
