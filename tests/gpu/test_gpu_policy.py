"""GPU-only checks (skipped without CUDA): the CUDA path of the policy against HF transformers.

On a GPU the model uses the transformer-engine spec when TE imports (local spec
otherwise), the alltoall token dispatcher and NCCL.
"""
from __future__ import annotations

import pytest
import torch

from moe_rl.policy.parity import compare, hf_logprobs, layout_worker, sample_sequences
from moe_rl.testing import run_ranks

pytestmark = pytest.mark.gpu


def _dispatcher_and_spec(hf_dir):
    from moe_rl.policy.model import build_model, read_hf_config, transformer_config, use_transformer_engine
    from moe_rl.policy.parallel import ParallelLayout, init_distributed

    arch = read_hf_config(hf_dir)
    init_distributed(ParallelLayout())
    cfg = transformer_config(arch, ParallelLayout())
    chunks = build_model(arch, ParallelLayout())
    return cfg.moe_token_dispatcher_type, use_transformer_engine(), type(chunks[0].decoder.layers[0].mlp).__name__


def test_cuda_path_uses_alltoall(tiny_hf_dir):
    (res,) = run_ranks(_dispatcher_and_spec, 1, str(tiny_hf_dir), backend="nccl")
    dispatcher, te, mlp = res
    print(f"dispatcher={dispatcher} transformer_engine={te} moe_layer={mlp}")
    assert dispatcher == "alltoall"


def test_cuda_logprobs_and_grads_match_cpu_reference(tiny_hf_dir):
    seqs = sample_sequences(128, num=8, max_len=20, seed=1)
    ref = hf_logprobs(tiny_hf_dir, seqs)
    (res,) = run_ranks(layout_worker, 1, "single", str(tiny_hf_dir), seqs, grads=True, backend="nccl")
    mx, mean = compare([res], ref)
    print(f"GPU fp32 vs HF CPU: max |dlogp| {mx:.2e} mean {mean:.2e}")
    assert mx <= 1e-3  # TF32-free fp32 on GPU vs CPU: kernels differ, so a looser bound than CPU parity
    assert all(torch.isfinite(g).all() for g in res["grads"].values())


def test_cuda_packed_rows_match_padded(tiny_hf_dir):
    """Packed rows on the GPU path vs padded: THD under transformer-engine (bf16: TE has no
    fp32 varlen attention, so bf16-sized tolerances), the mask in fp32 otherwise."""
    from moe_rl.policy.model import use_transformer_engine

    te = use_transformer_engine()
    dtype, tol_max, tol_mean, tol_grad = ("bf16", 0.1, 1e-2, 5e-2) if te else ("fp32", 1e-3, 1e-4, 1e-3)
    seqs = sample_sequences(128, num=8, max_len=20, seed=1)
    (res,) = run_ranks(layout_worker, 1, "single", str(tiny_hf_dir), seqs, grads=True, pack_tokens=40,
                       dtype=dtype, backend="nccl")
    n = [len(s) - 1 for s in seqs]
    padded = {i: res["logp"][j] for j, i in enumerate(res["index"])}
    packed = {i: res["logp_packed"][j] for j, i in enumerate(res["packed_index"])}
    diffs = torch.cat([(packed[i][: n[i]] - padded[i][: n[i]]).abs() for i in range(len(seqs))])
    print(f"GPU packed vs padded ({'THD' if te else 'mask'}, {dtype}): max |dlogp| {diffs.max():.2e} "
          f"mean {diffs.mean():.2e}")
    assert diffs.max() <= tol_max and diffs.mean() <= tol_mean
    for name, g in res["grads"].items():
        err = (res["grads_packed"][name].float() - g.float()).norm() / g.float().norm().clamp_min(1e-12)
        assert err <= tol_grad, f"{name}: packed vs padded relative gradient error {err:.2e}"
