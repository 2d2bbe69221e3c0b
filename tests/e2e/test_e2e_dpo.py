"""DPO end to end on CPU: `moe-rl train` with train.mode=dpo on 2 trainer ranks (EP2).

- the loss falls and the reward accuracy rises on the toy preference task; eval, the
  report, the reference cache and the exported HF checkpoint are there;
- a run of 6 steps resumed to 12 logs the same metrics as an uninterrupted 12-step run,
  and reads the reference log-probs from the cache instead of recomputing them;
- SIGTERM saves a checkpoint at the end of the current step and exits 0.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moe_rl.testing.e2e import sigterm_after_first_step

SMALL = ["log.tensorboard=false", "log.progress=false", "train.eval_every=6", "train.save_every=6",
         "drift.probe_size=8"]
COMPARED = ["loss/dpo", "dpo/reward_accuracy", "dpo/reward_margin", "perf/grad_norm", "drift/probe_volatility"]


def _args(run_dir, *overrides):
    return [sys.executable, "-m", "moe_rl.cli", "train", "--config", "launch/configs/tiny_cpu_dpo.yaml",
            f"log.run_dir={run_dir}", *SMALL, *overrides]


def _train(run_dir, *overrides):
    done = subprocess.run(_args(run_dir, *overrides), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dpo_full")
    return run_dir, _train(run_dir, "train.steps=12")


def test_dpo_learns_and_writes_its_outputs(full):
    run_dir, rows = full
    assert [r["step"] for r in rows] == list(range(1, 13))
    first, last = rows[:3], rows[-3:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert rows[0]["loss/dpo"] == pytest.approx(0.6931, abs=1e-3)  # π = π_ref at the first step: log 2
    assert mean(last, "loss/dpo") < mean(first, "loss/dpo") - 0.03
    assert mean(last, "dpo/reward_accuracy") > mean(first, "dpo/reward_accuracy") + 0.2
    assert "eval/reward_accuracy" in rows[5] and "eval/reward_accuracy" in rows[11]
    assert all(r["dpo/num_pairs"] == 30 for r in rows)
    assert any(k.startswith("drift/probe_volatility/layer_") for k in rows[0])
    assert (run_dir / "ref_logps.pt").is_file() and (run_dir / "hf" / "config.json").is_file()
    assert (run_dir / "report" / "preference.png").is_file()
    assert (run_dir / "report" / "probe_volatility_heatmap.png").is_file()


def test_moe_rl_export_of_a_dpo_checkpoint_gives_the_runs_own_export(full, tmp_path):
    # the step-12 checkpoint (2 ranks, EP2) read resharded by one process: the tensors the run
    # itself exported at its end, bit for bit
    from safetensors.torch import load_file

    run_dir, _ = full
    done = subprocess.run([sys.executable, "-m", "moe_rl.cli", "export", "--checkpoint",
                           str(run_dir / "checkpoints" / "step_000012"), "--out", str(tmp_path / "hf")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    tensors = lambda d: {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}  # noqa: E731
    ours, theirs = tensors(tmp_path / "hf"), tensors(run_dir / "hf")
    assert sorted(ours) == sorted(theirs) and all(ours[k].equal(theirs[k]) for k in ours)


def test_resume_gives_the_uninterrupted_run(full, tmp_path):
    _, rows = full
    _train(tmp_path, "train.steps=6")
    resumed = _train(tmp_path, "train.steps=12", "train.resume=auto")
    assert [r["step"] for r in resumed] == list(range(1, 13))
    for want, got in zip(rows[6:], resumed[6:]):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (got["step"], key)
    assert "reference log-probs of 225 pairs: read from" in (tmp_path / "train.log").read_text()


def test_sigterm_saves_a_checkpoint_and_exits_zero(tmp_path):
    from moe_rl.train.checkpoint import latest_checkpoint

    code, out = sigterm_after_first_step(_args(tmp_path, "train.steps=2000", "train.save_every=0"), tmp_path)
    assert code == 0, out[-3000:]
    ckpt = latest_checkpoint(tmp_path)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert ckpt is not None and json.loads((ckpt / "meta.json").read_text())["step"] == max(steps) < 2000
