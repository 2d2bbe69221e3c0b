"""The policy benchmarks: command lines, tables, parameter counts, and the GPU script's CPU dry run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "tools" / "bench"
MODULES = ("common", "overhead", "scaling", "weight_sync", "memory", "gpu_update", "step_options", "run_all",
           "handoff_bytes", "async_rl", "experts", "ckpt_memory",
           "route_intake", "lora")


@pytest.mark.parametrize("name", [m for m in MODULES if m != "common"])
def test_help(bench, name, capsys):
    with pytest.raises(SystemExit) as e:
        bench[name].main(["--help"])
    assert e.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_shape_params_match_transformers(bench):
    from transformers import Qwen3MoeForCausalLM

    from moe_rl.policy.tiny import TinyMoEConfig

    for shape in (bench["common"].BASE, bench["memory"].SHAPES[-1], bench["gpu_update"].DRY_SHAPE):
        cfg = TinyMoEConfig(**{k: getattr(shape, k) for k in shape.__dataclass_fields__}).to_hf()
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(cfg)
        assert shape.params() == sum(p.numel() for p in model.parameters())


def test_gpu_flops_formula(bench):
    gpu = bench["gpu_update"]
    shape = gpu.GPU_SHAPE
    assert 1e9 <= shape.params() <= 3e9
    n = shape.params(active=True) - shape.vocab_size * shape.hidden_size
    attn = 12 * shape.num_hidden_layers * shape.num_attention_heads * shape.head_dim * 2048
    assert gpu.flops(shape, 16, 2048, update=True) == (6 * n + attn) * 16 * 2048
    assert gpu.flops(shape, 16, 2048, update=False) == (2 * n + attn / 3) * 16 * 2048


def test_tables_from_rows(bench):
    common = bench["common"]
    ov = [{"layout": "single", "variant": v, "median_s": 1.0, "ratio": r, "cpu_s": r, "cpu_ratio": r, "cpu_iqr": (r, r),
           "schedule_s": 0.8, "outside_s": 0.2 * r, "mem_mb": 10.0, "base_mb": 300.0, "load": 0.5,
           "loss_diff": 0.0, "shape": common.BASE, "batch": 16, "seq": 128, "micro": 4, "rounds": 3}
          for v, r in (("bare", 1.0), ("moe_rl", 1.05))]
    text = bench["overhead"].format_table(ov)
    assert "| single | moe_rl | 1.000 | 1.050 | 1.050 [1.05–1.05] | 1.050 | 10 |" in text
    assert "Where the time goes, single" in text
    row = {"wall_s": 1.0, "cpu_s": 1.0, "ratio": 1.0, "cpu_ratio": 1.0, "mem_mb": 5.0, "rounds": 2}
    text = bench["scaling"].format_table({
        "experts": [{**row, "key": 8, "params": 2e6, "active": 1e6}],
        "seq": [{**row, "key": 64, "batch": 32, "micro": 8}],
        "layout": [{**row, "key": "single"}, {**row, "key": "ep2"}]})
    assert text.count("| ep2 | 2 |") == 1 and "By sequence length" in text
    assert common.paired_ratio([2.0, 3.0, 4.0], [1.0, 1.0, 2.0]) == 2.0


def test_run_all_finds_packing_when_present(bench):
    keys = [key for key, _, _ in bench["run_all"].sections()]
    assert keys[:11] == ["losses", "rollout", "replay", "overhead", "experts", "scaling", "weight_sync",
                         "weight_sync_scale", "weight_delta", "routes", "step_options"]
    assert ("packing" in keys) == (BENCH / "packing.py").is_file()


def test_gpu_update_dry_run(tmp_path):
    out = tmp_path / "gpu_bench.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MASTER_PORT", None)
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_update.py"), "--dry-run", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "update (moe_rl Policy.update)" in text and "update (bare megatron-core)" in text
    assert "MFU" in text and "moe_rl update / bare megatron-core update" in text


def test_async_summary_counts_the_steps_after_the_pipeline_filled(bench):
    rows = [{"step": s, "perf/step_s": 2.0 if s < 4 else 1.0, "perf/rollout_s": 0.5, "perf/weight_sync_s": 0.25,
             "rollout/staleness_mean": 1.5, "rollout/staleness_max": 2.0, "rollout/partial_frac": 0.1}
            for s in range(1, 7)]
    m = bench["async_rl"].summarize(2, rows, samples_per_step=10)  # K=2: from step 4, 3 steps of 1 s
    assert m["samples_per_s"] == 10.0 and m["wait_rollout"] == 0.5 and m["wait_push"] == 0.25
    assert (m["staleness_max"], m["partial_frac"]) == (2.0, pytest.approx(0.1))
