"""`moe_rl.train.preflight`: a checkpoint of another model is refused before any rank starts."""
from __future__ import annotations

import json

from moe_rl.config import load_config
from moe_rl.train.model_shape import model_shape
from moe_rl.train.preflight import preflight

CONFIG = "launch/configs/tiny_cpu.yaml"


def _checkpoint(run_dir, model: dict | None, step: int = 1):
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    meta = {"step": step, "world_size": 2, "format": "sharded", "files": {}}
    if model is not None:
        meta["model"] = model
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_a_checkpoint_of_another_model_is_refused_naming_the_key(tmp_path):
    saved = model_shape(load_config(CONFIG))  # what a run of the config's model records
    assert saved["num_local_experts"] == 4 and saved["vocab_size"] == 16
    ckpt = _checkpoint(tmp_path, json.loads(json.dumps(saved)))  # as read back from meta.json
    same = load_config(CONFIG, [f"train.resume={ckpt}"])
    assert preflight(same, 2) is None
    other = load_config(CONFIG, [f"train.resume={ckpt}", "model.tiny.num_experts=8"])
    problem = preflight(other, 2)
    assert problem.startswith("train.resume: ") and "num_local_experts=4" in problem and "num_local_experts=8" in problem
    # train.resume=auto checks the run directory's newest checkpoint the same way
    auto = load_config(CONFIG, ["train.resume=auto", f"log.run_dir={tmp_path}", "model.tiny.hidden_size=32"])
    assert "hidden_size=64" in preflight(auto, 2)


def test_a_checkpoint_without_the_model_record_is_left_to_resume(tmp_path):
    """Checkpoints written before meta.json recorded the model: nothing to compare here."""
    ckpt = _checkpoint(tmp_path, None)
    assert preflight(load_config(CONFIG, [f"train.resume={ckpt}", "model.tiny.num_experts=8"]), 2) is None


def test_in_place_pushes_refuse_a_running_server_that_keeps_a_prefix_cache(tmp_path):
    """rollout.urls servers are not started by the run, so nothing gave them --disable-radix-cache: an
    in-place push never flushes their cache, and a cached prompt would keep the old weights' KV and routes."""
    from moe_rl.rollout.local_engine import LocalEngine
    from moe_rl.rollout.server import ServerThread
    from moe_rl.testing import make_tiny_qwen3_moe

    model = make_tiny_qwen3_moe(tmp_path / "tiny")
    run = ["rollout.engine=sglang", "algo.max_staleness=1", "train.world_size=1", "parallel.ep=1",
           f"model.hf_path={model}"]
    with ServerThread(LocalEngine(model, max_cached_tokens=None)) as cached, \
            ServerThread(LocalEngine(model, max_cached_tokens=0)) as uncached:
        for url, mode, refused in ((cached.url, "in_place", True), (uncached.url, "in_place", False),
                                   (cached.url, "retract", False)):
            cfg = load_config("launch/configs/tiny_cpu.yaml", [*run, f"rollout.urls=[{url}]",
                                                               f"rollout.inflight_update={mode}"])
            problem = preflight(cfg, 1)
            if refused:
                assert problem and problem.startswith("rollout.inflight_update=in_place: the server " + url), problem
                assert "--disable-radix-cache" in problem
            else:
                assert problem is None, problem


def test_a_resume_path_that_is_not_a_checkpoint_says_what_it_is(tmp_path):
    """Missing (with the folder's step directories named), a file, or a directory without meta.json
    (an interrupted save): each in its own words, naming train.resume."""
    ckpt = _checkpoint(tmp_path, None, step=5)
    missing = ckpt.parent / "step_000050"
    problem = preflight(load_config(CONFIG, [f"train.resume={missing}"]), 2)
    assert problem.startswith(f"train.resume: {missing} does not exist (its folder holds step_000005)"), problem
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    problem = preflight(load_config(CONFIG, [f"train.resume={a_file}"]), 2)
    assert problem.startswith(f"train.resume: {a_file} is a file, not a checkpoint directory"), problem
    unfinished = ckpt.parent / "step_000006"
    unfinished.mkdir()
    problem = preflight(load_config(CONFIG, [f"train.resume={unfinished}"]), 2)
    assert problem.startswith(f"train.resume: {unfinished} is not a finished checkpoint (no meta.json: a save"), problem


def test_a_reward_that_does_not_import_or_is_misspelled_is_one_line_before_any_rank_starts(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_pf.py").write_text("def exact_match(text, answer):\n    return float(text == answer)\n")
    (tmp_path / "broken_rewards_pf.py").write_text("import no_such_package_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ok = load_config(CONFIG, ["reward.name=my_rewards_pf:exact_match"])
    assert preflight(ok, 2) is None
    cases = {
        "my_rewards_pf:exact_mach": "reward.name: reward 'my_rewards_pf:exact_mach': my_rewards_pf has no attribute "
                                    "'exact_mach' (did you mean 'exact_match'?)",
        "no_such_module_pf:score": "reward.name: reward 'no_such_module_pf:score': cannot import module "
                                   "'no_such_module_pf' (ModuleNotFoundError",
        "broken_rewards_pf:score": "reward.name: reward 'broken_rewards_pf:score': cannot import module "
                                   "'broken_rewards_pf' (ModuleNotFoundError: No module named 'no_such_package_anywhere')",
        "mathh": "reward.name: unknown reward 'mathh' (did you mean 'math'?)",
    }
    for name, want in cases.items():
        problem = preflight(load_config(CONFIG, [f"reward.name={name}"]), 2)
        assert problem is not None and problem.startswith(want) and "\n" not in problem, (name, problem)
