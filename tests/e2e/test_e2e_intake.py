"""`moe-rl train` with `rollout.intake=heads` against `rollout.intake=rank0` on 2 trainer ranks (DP2 x EP2),
`moe-rl serve` behind both: each data-parallel head a client of the server for its own groups, asynchronous
(algo.max_staleness=1), with DAPO's refill rounds, R3 and shuffled, token-balanced minibatches. The run
trains the same either way: every step's rewards, filter counts, advantages, losses and gradient norm
agree (tests/distributed/test_heads_intake.py checks the shares themselves)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.testing import free_ports

pytestmark = pytest.mark.slow

ARGS = ["--config", "launch/configs/tiny_cpu.yaml", "model.tiny.vocab_size=16", "parallel.ep=2", "rollout.n_samples=2",
        "rollout.max_new_tokens=3", "data.prompts_per_step=4", "algo.num_minibatches=2", "train.world_size=2",
        "train.lr=1e-3", "log.tensorboard=false", "log.report=false", "log.progress=false", "data.train=toy:add-easy",
        "algo.replay=r3", "algo.dynamic_sampling=true", "algo.shuffle_minibatches=true", "algo.max_staleness=1",
        "reward.name=moe_rl.testing.e2e:digit_first_reward", "train.steps=3", "train.save_every=0"]


def _train(run_dir: Path, intake: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", *ARGS, f"rollout.intake={intake}",
                           f"log.run_dir={run_dir}", f"rollout.base_port={free_ports(1)}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _agree(a: dict, b: dict) -> None:
    for key, value in a.items():
        # the engine's log-probs may differ in the last bits when two clients' requests share its batches
        if key.split("/")[0] in ("reward", "filter", "adv", "loss", "replay") or key == "perf/grad_norm":
            assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (a["step"], key)


def test_heads_intake_trains_as_rank0_does(tmp_path):
    ref, new = _train(tmp_path / "rank0", "rank0"), _train(tmp_path / "heads", "heads")
    assert "rollout.intake=heads" not in (tmp_path / "rank0" / "train.log").read_text()
    assert "2 data-parallel heads (trainer ranks 0, 1)" in (tmp_path / "heads" / "train.log").read_text()
    assert [r["step"] for r in new] == [r["step"] for r in ref] == [1, 2, 3]
    assert any(r.get("filter/rounds", 1) > 1 for r in ref), "no refill round: DAPO's path went unchecked"
    for a, b in zip(ref, new):
        assert b["rollout/staleness"] == a["rollout/staleness"]
        _agree(a, b)
