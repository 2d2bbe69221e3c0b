"""The prepared GPU check (tools/gpu_check.sh, tools/gpu/) where a CPU can check it: the dry run walks
every stage and the project's config loader accepts each `moe-rl train` command; an SGLang stage skips
with its reason when sglang does not import; a stage killed by its timeout still leaves its record;
the checks judge metrics as stated; the weight-sync stage's pushes and the engine-vs-trainer
comparison run for real on the CPU (gloo), and the comparison tells an engine with other weights."""
from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[3]
GPU = ROOT / "tools" / "gpu"
MODULES = ("plan", "checks", "driver", "stages", "engine_check")


@pytest.fixture(scope="module")
def gpu():
    """tools/gpu's modules by name (they import each other as scripts do)."""
    sys.path.insert(0, str(GPU))
    try:
        yield SimpleNamespace(**{m: importlib.import_module(m) for m in ("plan", "checks", "driver")})
    finally:
        while str(GPU) in sys.path:  # the driver and stages.py put their directory there too
            sys.path.remove(str(GPU))
        for m in MODULES:
            sys.modules.pop(m, None)


def _check(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    run_env = {k: v for k, v in os.environ.items() if k not in ("DRY_RUN", "WHEELS", "GPU_CHECK_ALLOW_CPU")}
    run_env.update(OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), PY=sys.executable, **(env or {}))
    return subprocess.run(["bash", "tools/gpu_check.sh", *args], cwd=ROOT, env=run_env, capture_output=True,
                          text=True, timeout=300)


def _records(tmp_path: Path) -> dict[str, dict]:
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    return {r["stage"]: r for r in data["stages"]}


def test_dry_run_walks_every_stage_and_the_configs_load(tmp_path, gpu):
    res = _check(tmp_path, env={"DRY_RUN": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    records = _records(tmp_path)
    assert list(records) == gpu.plan.stage_names()
    for stage in gpu.plan.STAGES:
        r = records[stage.name]
        assert r["status"] == "dry", r
        assert r["seconds"] >= 0 and r["timeout_s"] == stage.timeout_s and r["reason"]
        assert len(r["commands"]) == len(stage.commands)
        for cmd in r["commands"]:
            assert f"$ {cmd}" in res.stdout  # printed as it would run
        if any(c.is_train for c in stage.commands):
            assert "configs accepted" in r["reason"]
    assert "moe_rl.cli train --config launch/configs/tiny_cpu_tool.yaml" in res.stdout
    assert (tmp_path / "out" / "gpu_check.log").read_text().count("=== ") == len(gpu.plan.STAGES)
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())  # nothing ran
    # the flag does what the variable does
    flag = _check(tmp_path / "flag", "--dry-run", "--only", "environment,async")
    assert flag.returncode == 0, flag.stdout + flag.stderr
    assert [r["status"] for r in _records(tmp_path / "flag").values()] == ["dry", "dry"]


def test_the_train_commands_pass_only_through_the_config_loader(gpu):
    """The dry run's check refuses what `moe-rl train` would: a bad override, a placement that needs
    more GPUs than the one the lease has."""
    base = [sys.executable, "-m", "moe_rl.cli", "train", "--config", gpu.plan.TINY, *gpu.plan.ONE_GPU]
    assert gpu.driver.validate_train(base) is None
    assert "algo.replay" in gpu.driver.validate_train(base + ["algo.replay=r9"])
    assert "reward.name" in gpu.driver.validate_train(base + ["reward.name=moe_rl.testing.e2e:no_such_reward"])
    sglang = [sys.executable, "-m", "moe_rl.cli", "train", "--config", gpu.plan.TINY, "train.world_size=1",
              "parallel.ep=1", "rollout.engine=sglang"]  # not colocated: its own GPU after the trainer's
    assert "rollout.num_servers" in gpu.driver.validate_train(sglang, gpus=1)
    assert gpu.driver.validate_train(sglang, gpus=2) is None


def test_stage_timeouts_fit_the_lease(gpu):
    """Each stage's timeout is stated and the GPU stages' sum fits the check's budget (9-minute lease,
    the machine's start included)."""
    gpu_stages = [s for s in gpu.plan.STAGES if not s.sglang]
    assert all(0 < s.expected_s < s.timeout_s for s in gpu.plan.STAGES)
    assert sum(s.timeout_s for s in gpu_stages) <= gpu.plan.BUDGET_S <= 8 * 60


def test_sglang_stages_skip_with_the_reason_when_sglang_does_not_import(tmp_path):
    shadow = tmp_path / "shadow" / "sglang"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: no CUDA wheels here')\n")
    env = {"PYTHONPATH": str(tmp_path / "shadow")}
    res = _check(tmp_path, "--only", "r3_decode_sglang,weight_sync_sglang,colocated_sglang", env=env)
    assert res.returncode == 0, res.stdout + res.stderr  # skips are not failures
    records = _records(tmp_path)
    assert set(records) == {"r3_decode_sglang", "weight_sync_sglang", "colocated_sglang"}
    for r in records.values():
        assert r["status"] == "skip", r
        assert "sglang does not import" in r["reason"] and "simulated: no CUDA wheels here" in r["reason"]
    # the stage itself says the same when run alone
    figures = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, "tools/gpu/stages.py", "r3-decode", "--engine", "sglang", "--work",
                          str(tmp_path / "w"), "--figures", str(figures)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path / 'shadow'}{os.pathsep}{ROOT}"}, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    record = json.loads(figures.read_text())
    assert record["status"] == "skip" and "simulated: no CUDA wheels here" in record["reason"]


def test_a_stage_killed_by_its_timeout_leaves_its_record(tmp_path, gpu):
    """A stage past its timeout is killed with the processes it started, and its record says so;
    results.json exists from the start with every stage failed as not run."""
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)")
    stage = gpu.plan.Stage("hang", "a stage that never ends", timeout_s=2, expected_s=1,
                           commands=(gpu.plan.Command("hang", ("{py}", "-c", code)),), check="pytest_summary")
    results = gpu.driver.Results(tmp_path, [stage], budget_s=60, dry=False)
    first = json.loads((tmp_path / "results.json").read_text())["stages"][0]
    assert first["status"] == "fail" and first["reason"].startswith("not run")
    t0 = time.monotonic()
    record = gpu.driver.run_stage(stage, py=sys.executable, work=tmp_path / "work", out=tmp_path, timeout_s=2,
                                  env=dict(os.environ))
    assert time.monotonic() - t0 < 2 + gpu.driver.KILL_GRACE_S + 5
    results.set("hang", {**record, "seconds": 2.0})
    saved = json.loads((tmp_path / "results.json").read_text())["stages"][0]
    assert saved["status"] == "fail" and saved["reason"] == "timeout after 2 s (in hang)"
    assert "started" in saved["log_tail"]
    child = int(pid_file.read_text())
    for _ in range(50):  # the grandchild went with the stage's process group
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the stage's child {child} survived its timeout")


def _run_dir(root: Path, name: str, rows: list[dict]) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_colocated_check(tmp_path, gpu):
    rows = [{"step": i, "reward/mean": 0.1 * i, "drift/logp_abs_diff": 1e-6} for i in range(1, 5)]
    runs = {"colocated_true": _run_dir(tmp_path, "t", rows), "colocated_false": _run_dir(tmp_path, "f", rows)}
    assert gpu.checks.colocated(runs, "", steps=4)["status"] == "pass"
    other = [dict(r, **({"reward/mean": 0.5} if r["step"] == 3 else {})) for r in rows]
    runs["colocated_false"] = _run_dir(tmp_path, "f2", other)
    res = gpu.checks.colocated(runs, "", steps=4)
    assert res["status"] == "fail" and "steps [3]" in res["reason"]
    off = [dict(r, **{"drift/logp_abs_diff": 0.02}) for r in rows]
    runs = {"colocated_true": _run_dir(tmp_path, "t3", off), "colocated_false": _run_dir(tmp_path, "f3", off)}
    assert "0.02 > 0.001" in gpu.checks.colocated(runs, "", steps=4)["reason"]


def test_async_check_needs_the_overlap_and_measures_samples_per_s(tmp_path, gpu):
    def rows(stale: float) -> list[dict]:
        return [{"step": i, "time": 100.0 + 2 * i, "loss/num_seqs": 64, "perf/step_s": 2.0,
                 "rollout/staleness_max": 0.0 if i == 1 else stale} for i in range(1, 6)]
    runs = {"k0": _run_dir(tmp_path, "k0", rows(0.0)), "k1": _run_dir(tmp_path, "k1", rows(1.0))}
    res = gpu.checks.async_compare(runs, "", steps=5)
    assert res["status"] == "pass" and res["samples_per_s_k0"] == pytest.approx(4 * 64 / 8)
    runs["k1"] = _run_dir(tmp_path, "k1b", rows(0.0))
    assert "no overlap" in gpu.checks.async_compare(runs, "", steps=5)["reason"]


def test_two_turn_check_needs_second_turns(tmp_path, gpu):
    row = {"drift/logp_abs_diff": 1e-7, "drift/rollout_mismatch": 0.0, "replay/coverage": 1.0,
           "drift/logp_by_turn/1/abs_diff": 1e-7, "drift/rollout_mismatch_by_turn/1/num_tokens": 12.0,
           "rollout/turns_mean": 1.3}
    res = gpu.checks.two_turn({"tool_r3": _run_dir(tmp_path, "a", [row] * 3)}, "", steps=3)
    assert res["status"] == "pass" and res["turn1_tokens"] == 36
    one_turn = dict(row, **{"drift/rollout_mismatch_by_turn/1/num_tokens": 0.0,
                            "drift/logp_by_turn/1/abs_diff": "NaN"})
    res = gpu.checks.two_turn({"tool_r3": _run_dir(tmp_path, "b", [one_turn] * 3)}, "", steps=3)
    assert res["status"] == "fail" and "no second-turn token" in res["reason"]
    flipped = dict(row, **{"drift/rollout_mismatch": 0.2})
    assert "route mismatch 0.2" in gpu.checks.two_turn({"tool_r3": _run_dir(tmp_path, "c", [flipped] * 3)}, "",
                                                       steps=3)["reason"]


def test_pytest_summary_check(gpu):
    assert gpu.checks.pytest_summary({}, "...\n3 passed in 12.31s\n")["status"] == "pass"
    bad = gpu.checks.pytest_summary({}, "F..\n1 failed, 2 passed, 1 warning in 9.0s\n")
    assert bad["status"] == "fail" and bad["failed"] == 1 and bad["passed"] == 2
    assert "no test passed" in gpu.checks.pytest_summary({}, "sss\n3 skipped in 0.5s\n")["reason"]


def test_weight_sync_stage_pushes_on_cpu(tmp_path):
    """The weight-sync stage on the CPU: disk, tensor and the nccl protocol over gloo into `moe-rl serve`;
    each push moves the served log-probs from the pre-step weights onto the trainer's."""
    figures = tmp_path / "figures.json"
    res = subprocess.run([sys.executable, "tools/gpu/stages.py", "weight-sync", "--work", str(tmp_path / "w"),
                          "--figures", str(figures), "--hidden", "32", "--experts", "4", "--vocab", "64",
                          "--pushes", "1", "--samples", "4", "--new-tokens", "8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "GPU_CHECK_ALLOW_CPU": "1", "PYTHONPATH": str(ROOT),
                              "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    record = json.loads(figures.read_text())
    assert record["status"] == "pass", record
    for method in ("disk", "nccl_gloo", "tensor"):
        assert record[f"{method}_s"] > 0
        assert record[f"{method}_pre_logp_abs_diff"][0] > 1e-2 > 1e-3 >= record[f"{method}_post_logp_abs_diff"][0]


def _compare_worker(hf_dir: str, other_dir: str) -> list[dict]:
    sys.path.insert(0, str(GPU))
    import engine_check as ec

    from moe_rl.rollout.local_engine import LocalEngine

    ec.one_rank()
    policy = ec.build_policy(hf_dir)
    asks = ec.prompts(4, 6, 128, seed=2)
    out = []
    for model in (hf_dir, other_dir):
        engine = LocalEngine(model)
        out.append(ec.compare(policy, ec.generate(engine, asks, 12, seed=5)))
        engine.close()
    return out


def test_engine_check_tells_an_engine_with_other_weights(tmp_path, gpu):
    from moe_rl.testing import make_tiny_qwen3_moe, run_ranks

    same, other = (str(make_tiny_qwen3_moe(tmp_path / f"m{s}", seed=s)) for s in (0, 1))
    ec = importlib.import_module("engine_check")  # tools/gpu is on sys.path while `gpu` is in use
    good, bad = run_ranks(_compare_worker, 1, same, other)[0]
    assert good["decoded_tokens"] == 12 and good["samples"] == 4
    assert ec.judge(good, 1e-3, 0.01) == []
    problems = ec.judge(bad, 1e-3, 0.01)
    assert any("mean |d log p|" in p for p in problems) and any("decode route mismatch" in p for p in problems)
    assert math.isfinite(bad["logp_abs_max_r3"]) and bad["route_mismatch_prefill"] > 0
