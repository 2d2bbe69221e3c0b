"""Megatron policy under every parallel layout vs HF transformers, on gloo ranks.

One run per layout checks several things at once (process start-up dominates the cost):
log-probs vs HF (≤ 1e-4 in fp32), the HF -> megatron -> HF round trip (bit-exact),
packed rows (token-balanced DP shards, several sequences per row) vs the padded
computation of the same layout (≤ 1e-5), and for some layouts the gradient of a
fixed loss, padded and packed, vs the single-process padded run (relative error
≤ 1e-4 per parameter).
"""
from __future__ import annotations

import pytest
import torch

from moe_rl.policy.convert import HFCheckpoint
from moe_rl.policy.parity import compare, hf_logprobs, layout_worker, sample_sequences
from moe_rl.testing import run_ranks

LAYOUTS = ["tp2", "pp2", "pp2-vpp2", "ep2", "tp2-ep2", "tp2-pp2", "dp2"]
GRAD_LAYOUTS = {"tp2-pp2", "tp2-ep2", "dp2", "pp2-vpp2"}  # vpp: 4 micro-batches, more than its 2 stages
PACK_TOKENS = 40  # two or three of the test sequences (2..20 tokens) per packed row


@pytest.fixture(scope="module")
def sequences():
    return sample_sequences(vocab_size=128, num=8, max_len=20, seed=1)


@pytest.fixture(scope="module")
def reference(tiny_hf_dir, sequences):
    return hf_logprobs(tiny_hf_dir, sequences)


@pytest.fixture(scope="module")
def single(tiny_hf_dir, sequences):
    """Single-process megatron run: log-probs and gradients (the reference for gradients)."""
    (res,) = run_ranks(layout_worker, 1, "single", str(tiny_hf_dir), sequences, grads=True)
    return res


def _hf_tensors(path):
    ckpt = HFCheckpoint(path)
    return {name: ckpt.get(name) for name in ckpt.weight_map}


def test_single_process_matches_hf(single, reference):
    mx, _ = compare([single], reference)
    assert mx <= 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_logprobs_roundtrip_and_grads(layout, tiny_hf_dir, sequences, reference, single, tmp_path):
    from moe_rl.policy.parallel import ParallelLayout

    world = ParallelLayout.parse(layout).world_size
    out = tmp_path / "export"
    results = run_ranks(layout_worker, world, layout, str(tiny_hf_dir), sequences, export_dir=str(out),
                        grads=layout in GRAD_LAYOUTS, pack_tokens=PACK_TOKENS, timeout=600)

    mx, _ = compare(results, reference)
    assert mx <= 1e-4, f"{layout}: max |Δ log p| = {mx:.2e}"
    _check_packed(layout, results, sequences)

    original, exported = _hf_tensors(tiny_hf_dir), _hf_tensors(out)
    assert sorted(original) == sorted(exported)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name

    if layout in GRAD_LAYOUTS:
        for key in ("grads", "grads_packed"):
            grads = {}
            for r in results:
                for name, g in r[key].items():
                    assert name not in grads, f"{name} returned by two ranks"
                    grads[name] = g
            assert sorted(grads) == sorted(single["grads"])
            for name, ref in single["grads"].items():
                err = (grads[name] - ref).norm() / ref.norm().clamp_min(1e-12)
                assert err <= 1e-4, f"{layout} {key}: {name} relative gradient error {err:.2e}"


def _check_packed(layout, results, sequences):
    """Packed log-probs of every sequence equal the padded ones of the same layout (≤ 1e-5)."""
    padded = {i: r["logp"][j] for r in results for j, i in enumerate(r["index"])}
    packed = {i: r["logp_packed"][j] for r in results for j, i in enumerate(r["packed_index"])}
    assert sorted(packed) == list(range(len(sequences)))
    for i, seq in enumerate(sequences):
        n = len(seq) - 1
        diff = (packed[i][:n] - padded[i][:n]).abs().max().item()
        assert diff <= 1e-5, f"{layout}: sequence {i} packed vs padded max |Δ log p| = {diff:.2e}"


def test_export_writes_sharded_index(tiny_hf_dir, tmp_path):
    """Small shard size forces several files: the index maps every tensor and transformers loads it."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sharded"
    run_ranks(_export_sharded, 1, str(tiny_hf_dir), str(out))
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    a = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir))
    b = AutoModelForCausalLM.from_pretrained(str(out))
    for (n1, p1), (n2, p2) in zip(a.state_dict().items(), b.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def _export_sharded(hf_dir, out):
    import json
    from pathlib import Path

    from moe_rl.policy.convert import export_hf, load_hf_weights
    from moe_rl.policy.model import build_model, read_hf_config
    from moe_rl.policy.parallel import ParallelLayout, init_distributed

    arch = read_hf_config(hf_dir)
    layout = ParallelLayout()
    init_distributed(layout)
    chunks = build_model(arch, layout)
    load_hf_weights(chunks, hf_dir, arch)
    export_hf(chunks, out, arch, json.loads((Path(hf_dir) / "config.json").read_text()), max_shard_bytes=64 << 10)


def test_second_init_reuses_groups_of_the_same_layout_only():
    (msg, _) = run_ranks(_init_twice, 2)
    assert "already has parallel groups for tp/pp/vpp/ep/etp = (1, 1, None, 2, 1)" in msg and "tp2" in msg


def _init_twice():
    from megatron.core import parallel_state as ps

    from moe_rl.policy.parallel import LayoutError, ParallelLayout, init_distributed

    init_distributed(ParallelLayout.parse("ep2"))
    group = ps.get_expert_model_parallel_group()
    init_distributed(ParallelLayout.parse("ep2"))  # same layout: the groups stay
    assert ps.get_expert_model_parallel_group() is group
    try:
        init_distributed(ParallelLayout.parse("tp2"))
    except LayoutError as exc:
        return str(exc)
    return "no error"


def test_check_parity_cli_with_packing(tiny_hf_dir, tmp_path):
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "parity.json"
    cmd = [sys.executable, "-m", "moe_rl.cli", "check-parity", "--hf-model", str(tiny_hf_dir), "--layouts", "ep2",
           "--pack-tokens", "48", "--json", str(out)]
    env = {**os.environ, "COLUMNS": "160"}  # the table's width when not on a terminal
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "packed max |Δ log p|" in res.stdout
    (row,) = json.loads(out.read_text())
    assert row["layout"] == "ep2" and row["ok"] and row["packed_max_abs_diff"] <= 1e-4

    bad = subprocess.run(cmd[:-4] + ["--pack-tokens", "10"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--pack-tokens 10 cannot hold a 24-token sequence" in bad.stderr
