"""The whole RL loop on CPU: 2 trainer ranks (EP2), the local engine behind `moe-rl serve`.

- every objective x every replay mode runs a step: finite loss, the promised
  metric keys, weights change, and the engine's log-probs match the trainer's
  after each weight sync;
- resume from a checkpoint gives the same next-step metrics as an uninterrupted run;
- Ctrl-C checkpoints and exits 0 (SIGTERM: tests/faults/), twice stops at once; a half-written checkpoint is ignored;
- config errors stop `moe-rl train` before any work with the promised message.
"""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.testing import free_ports, run_ranks
from moe_rl.testing.e2e import objective_matrix_worker, sigterm_after_first_step

LOSSES = ["grpo", "dapo", "gspo", "gspo_token", "sapo"]
REPLAYS = ["off", "r2", "r3"]
SMALL = ["model.tiny.vocab_size=16", "parallel.ep=2", "parallel.micro_batch_size=2",
         "parallel.max_tokens_per_microbatch=null",  # padded micro-batches; the matrix ends with packed steps
         "rollout.n_samples=4", "rollout.max_new_tokens=2", "data.prompts_per_step=4", "algo.num_minibatches=2", "train.world_size=2",
         "train.lr=1e-3", "log.tensorboard=false", "log.report=false", "log.progress=false", "data.train=toy:add-easy",
         "drift.every=1", "drift.probe_every=1"]  # the demo measures drift every 5th step; these check every step
KEYS = ["reward/mean", "reward/success_rate", "loss/pg_loss", "perf/grad_norm", "loss/ratio_mean",
        "drift/volatility", "drift/rollout_mismatch", "drift/logp_abs_diff", "perf/tokens_per_s",
        "drift/route_margin", "drift/route_gate_mass/layer_00"]
# SAPO has no hard clip, CISPO clips the IS weight only; the others report clip fractions
LOSS_KEYS = {"sapo": "loss/sapo_gate_mean", "cispo": "loss/is_weight_clip_frac_high"}


def _cli(args, **kw):
    """`moe-rl ARGS`, with the rollout server on a free port (tests may run beside other servers)."""
    args = [*args, f"rollout.base_port={free_ports(1)}"] if args and args[0] == "train" else args
    return subprocess.run([sys.executable, "-m", "moe_rl.cli", *args], capture_output=True, text=True, **kw)


def test_every_objective_and_replay_mode(tmp_path):
    # T = 0.7: engine and trainer both give log_softmax(logits / T); a reward that differs between
    # samples, so every step has advantages and must move the weights.
    cfg = load_config("launch/configs/tiny_cpu.yaml", SMALL + [
        f"log.run_dir={tmp_path}", f"rollout.base_port={free_ports(1)}", "rollout.temperature=0.7",
        "reward.name=moe_rl.testing.e2e:varied_reward", "drift.per_update=true",
        "algo.rollout_correction.mode=icepop"])
    # one step with the route mask beside IcePop (under R2: the trainer routes itself)
    combos = [(loss, replay) for loss in LOSSES for replay in REPLAYS] + [("cispo", "r2"), ("gmpo", "r3"),
                                                                          ("gspo", "r2", {"max_flips": 0})]
    results = run_ranks(objective_matrix_worker, 2, cfg.to_dict(), str(tmp_path), combos, timeout=900)
    assert sum(1 for r in results[0] if r.get("packed")) == 2  # then two packed steps (r2, r3) with DP balancing
    overlap = [r["metrics"]["rollout/staleness"] for r in results[0] if r.get("overlap")]
    # with overlap every step after the first trains one version behind; in place (the last two) too,
    # and no token is older than that, whether its sample spans two versions or one
    assert overlap == [0.0, 1.0, 1.0, 1.0, 1.0], overlap
    in_place = [r["metrics"] for r in results[0] if r.get("in_place")]
    assert len(in_place) == 2 and all(m["rollout/staleness_max"] <= 1.0 for m in in_place)
    assert all(0.0 <= m["rollout/partial_frac"] <= 1.0 for m in in_place)
    for r in results[0]:
        if r.get("overlap"):
            assert math.isfinite(r["metrics"]["loss/pg_loss"])
            continue
        m = r["metrics"]
        name = f"{r['loss']}/{r['replay']}" + ("/packed" if r.get("packed") else "") + (
            "/route_mask" if r.get("route_mask") else "")
        for key in KEYS + [LOSS_KEYS.get(r["loss"], "loss/clip_frac_high")]:
            assert key in m, f"{name}: metric {key} missing"
        assert math.isfinite(m["loss/pg_loss"]) and math.isfinite(m["perf/grad_norm"]), name
        # Two microbatches per minibatch: per-token means are combined, not added up.
        assert 0.5 < m["loss/ratio_mean"] < 1.5, f"{name}: loss/ratio_mean {m['loss/ratio_mean']}"
        assert m["loss/ratio_min"] <= m["loss/ratio_mean"] <= m["loss/ratio_max"], name
        assert m["adv/abs_mean"] > 0, f"{name}: the varied reward gave no advantages"
        assert r["weight_change"] > 0, f"{name}: weights did not change"
        # The engine serves the weights of the previous step's sync: same log-probs as the trainer (at T = 0.7).
        assert m["drift/logp_abs_diff"] <= 1e-4, f"{name}: engine vs trainer |Δ log p| {m['drift/logp_abs_diff']}"
        # Route distance is a metric, so the probe's change over the step's 2 updates is at most the
        # sum of its per-update changes (2 x their mean).
        assert 0.0 <= m["drift/volatility_per_update"] <= 1.0, name
        if "drift/probe_volatility" in m:
            assert m["drift/probe_volatility"] <= 2 * m["drift/volatility_per_update"] + 1e-9, name
        # IcePop masks nothing when engine and trainer agree (they do, see above)
        assert m["correction/masked_token_frac"] == 0.0, name
        assert 0.5 < m["correction/ratio_min"] <= m["correction/ratio_max"] < 5.0, name
        if "replay_check" in r:
            assert r["replay_check"] == "ok", f"{name}: {r['replay_check']}"
        if r["replay"] == "r3":  # every response and prompt token replayed an engine route
            assert m["replay/coverage"] == 1.0 and m["replay/coverage_prompt"] == 1.0, name
        flips = [v for k, v in m.items() if k.startswith("correction/route_flip_frac/layer_")]
        if r.get("route_mask"):  # max_flips 0: masked = the tokens with a flip in any layer
            assert len(flips) == 4 and max(flips) <= m["correction/route_masked_frac"] <= sum(flips), name
        else:
            assert not flips and "correction/route_masked_frac" not in m, name
    ranks_agree = [r["metrics"]["reward/mean"] for r in results[1]] == [r["metrics"]["reward/mean"] for r in results[0]]
    assert ranks_agree


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(r["step"]): r for r in rows}


@pytest.mark.slow
def test_resume_gives_the_same_next_steps(tmp_path):
    base = ["--config", "launch/configs/tiny_cpu.yaml", *SMALL, "train.save_every=2", "drift.probe_every=1"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    a = _cli(["train", *base, "train.steps=4", f"log.run_dir={straight}"], timeout=900)
    assert a.returncode == 0, a.stderr[-3000:]
    step2 = straight / "checkpoints" / "step_000002"  # the uninterrupted run's own checkpoint of step 2
    c = _cli(["train", *base, "train.steps=4", "train.export_hf=true", f"train.resume={step2}",
              f"log.run_dir={resumed}"], timeout=900)
    assert c.returncode == 0, c.stderr[-3000:]
    assert "resumed from" in (resumed / "train.log").read_text()
    assert not (straight / "report").exists()  # log.report=false: `moe-rl report` writes it later
    assert "healthy again" not in (straight / "train.log").read_text()  # it never was unhealthy
    ma, mb = _metrics(straight), _metrics(resumed)
    assert sorted(mb) == [3, 4]
    for step in (3, 4):
        for key, value in ma[step].items():
            if key.split("/")[0] in ("reward", "loss", "adv") or key in ("drift/volatility", "perf/grad_norm"):
                assert mb[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)
    # The step-2 checkpoint under another layout is tests/distributed/test_dist_checkpoint.py's (weights and
    # optimizer state equal after the reshard) and the resubmitted SLURM job's in tests/e2e/test_e2e_slurm.py.
    assert (resumed / "hf" / "config.json").is_file()  # train.export_hf: the policy at the end, in HF form
    # a checkpoint of another model: refused before any rank starts, one line naming the key, exit 2
    bad = _cli(["train", *base, "model.tiny.num_experts=8", f"train.resume={step2}", f"log.run_dir={tmp_path}/other"])
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert len(bad.stderr.strip().splitlines()) == 1 and "num_local_experts=4" in bad.stderr, bad.stderr
    # moe-rl export: the step-2 checkpoint as a HF checkpoint, with the run's tokenizer-free source files
    hf = tmp_path / "hf"
    e = _cli(["export", "--checkpoint", str(step2), "--out", str(hf)], timeout=600)
    assert e.returncode == 0, e.stderr[-3000:]
    assert (hf / "config.json").is_file() and list(hf.glob("*.safetensors"))
    again = _cli(["export", "--checkpoint", str(step2), "--out", str(hf)])
    assert again.returncode == 2 and "is not empty" in again.stderr
    _serves_like_transformers(hf)


def _serves_like_transformers(model_dir: Path) -> None:
    """`moe-rl serve --model DIR` loads the export, and its greedy log-probs are transformers' on it."""
    import urllib.request

    import torch
    from transformers import AutoModelForCausalLM

    from moe_rl.testing.serve import start_serve_process, stop_process

    prompt = [3, 4, 5, 6]
    srv = start_serve_process(model_dir)
    try:
        body = {"input_ids": prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
        req = urllib.request.Request(srv.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
    finally:
        stop_process(srv.proc)
    ids, served = out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), -1)[len(prompt) - 1:-1]
    assert ids == lp.argmax(-1).tolist()  # greedy under the exported weights
    assert served == pytest.approx(lp.gather(1, torch.tensor(ids).view(-1, 1)).view(-1).tolist(), abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("signals", [[signal.SIGINT], [signal.SIGINT, signal.SIGINT]], ids=["ctrl-c", "ctrl-c-twice"])
def test_stop_signals(tmp_path, signals):
    """One Ctrl-C: a checkpoint of the step, exit 0; a second Ctrl-C: stop at once, exit 130.
    Signals go to the whole process group, as a terminal sends them. (SIGTERM to the process
    group, as SLURM sends it: tests/faults/test_run_faults.py, in an asynchronous run.)"""
    code, out = sigterm_after_first_step([sys.executable, "-m", "moe_rl.cli", "train", "--config",
                                          "launch/configs/tiny_cpu.yaml", *SMALL, "train.steps=200",
                                          f"log.run_dir={tmp_path}", f"rollout.base_port={free_ports(1)}"], tmp_path,
                                         signals=tuple(signals), gap_s=0.02)
    assert "Traceback" not in out, out[-3000:]
    from moe_rl.train.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(tmp_path)
    if len(signals) == 2:
        assert code == 130 and "stopping now" in out, out[-3000:]
        # Stopped inside a step, nothing of it saved; a step may have ended (and been saved
        # whole) before the second Ctrl-C landed: steps take half a second here.
        assert ckpt is None or len(list(ckpt.glob("rank_*.pt"))) == 2, sorted(ckpt.iterdir())
        return
    assert code == 0, out[-3000:]
    assert ckpt is not None and len(list(ckpt.glob("rank_*.pt"))) == 2
    steps = _metrics(tmp_path)
    assert json.loads((ckpt / "meta.json").read_text())["step"] == max(steps) < 200


def test_half_written_checkpoint_is_ignored(tmp_path):
    from moe_rl.train.checkpoint import latest_checkpoint

    good = tmp_path / "checkpoints" / "step_000002"
    good.mkdir(parents=True)
    (good / "meta.json").write_text('{"step": 2, "world_size": 2}')
    partial = tmp_path / "checkpoints" / "step_000004.tmp"
    partial.mkdir()
    (partial / "rank_00000.pt").write_bytes(b"truncated")
    assert latest_checkpoint(tmp_path) == good


@pytest.mark.parametrize("override,message", [
    ("algo.loss=gspox", "algo.loss: 'gspox' is not one of"),
    ("parallel.ep=3", "parallel.ep"),
    ("train.stepz=3", "did you mean 'train.steps'"),
])
def test_config_errors_stop_before_any_work(tmp_path, override, message):
    """A config that does not load: exit 2, the message on stderr and in the named run directory's
    train.log (the place a batch job's user looks), and nothing else written there."""
    r = _cli(["train", "--config", "launch/configs/tiny_cpu.yaml", override, f"log.run_dir={tmp_path}/run"])
    assert r.returncode == 2
    assert message in r.stderr
    assert [f.name for f in (tmp_path / "run").iterdir()] == ["train.log"]
    assert message in (tmp_path / "run" / "train.log").read_text()


def test_bad_dataset_row_names_file_and_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 5}\n')
    r = _cli(["train", "--config", "launch/configs/tiny_cpu.yaml", f"data.train={data}", "data.eval=null", "train.eval_every=0",
              "train.world_size=1", "parallel.ep=1", f"log.run_dir={tmp_path}/run"], timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"{data}:2" in r.stderr


@pytest.mark.parametrize("overrides,message", [
    (["parallel.ep=4", "parallel.pp=2", "train.world_size=3"], "world size 3 is not divisible by tp*pp = 1*2"),
    (["model.hf_path=/nonexistent/model"], "model.hf_path: /nonexistent/model has no config.json"),
    (["train.resume=/nonexistent/ckpt"], "train.resume: /nonexistent/ckpt does not exist"),
    (["train.lr=inf"], "train.lr: inf must be a finite number"),
    (["data.train=/nonexistent/rows.jsonl"], "data.train: /nonexistent/rows.jsonl: no such file"),
    (["model.tiny.vocab_size=8"], "outside the model's vocabulary [0, 8)"),
    (["reward.name=no_such_module:score"], "reward.name: reward 'no_such_module:score': cannot import module"),
], ids=["layout", "hf_path", "resume", "lr", "data", "vocab", "reward"])
def test_mistakes_found_before_any_rank_starts(tmp_path, overrides, message):
    """One line naming the field, exit 2, no traceback; written to train.log when the run dir is named."""
    r = _cli(["train", "--config", "launch/configs/tiny_cpu.yaml", *overrides, f"log.run_dir={tmp_path}/run"],
             timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert message in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.slow
def test_demo_config_learns_the_easy_task(tmp_path):
    """Seeded: success starts near chance (1/16) and greedy eval success reaches >= 0.8 by step 20
    (the demo's run: 1.0 there, 0.78 at step 10)."""
    r = _cli(["train", "--config", "launch/configs/tiny_cpu.yaml", "train.steps=20", "train.save_every=0",
              "log.tensorboard=false", "log.progress=false", f"log.run_dir={tmp_path}"], timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    m = _metrics(tmp_path)
    assert m[1]["reward/success_rate"] <= 0.25
    assert m[20]["eval/success_rate"] >= 0.8, {s: m[s].get("eval/success_rate") for s in m}
    assert (tmp_path / "report" / "volatility_heatmap.png").is_file()
