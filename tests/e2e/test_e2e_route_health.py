"""Routes corrupted on purpose stop an R3 run loudly, naming the cause, before any update trains on
them: a server whose MoE layers are shifted by one (valid ids, so only the trainer's own routes can
tell: the layer-offset check) and a server that pads its routes with zeros (rows no router
produced, refused where they enter). One trainer rank with the engine in its process."""
from __future__ import annotations

from moe_rl.config import load_config
from moe_rl.testing import run_ranks
from moe_rl.testing.corrupt_routes_worker import corrupt_routes_worker

OVERRIDES = ["train.world_size=1", "parallel.ep=1", "rollout.engine=inprocess", "rollout.weight_sync=tensor",
             "algo.replay=r3", "rollout.return_routed_experts=true", "model.tiny.vocab_size=16",
             "data.prompts_per_step=4", "rollout.n_samples=4", "rollout.max_new_tokens=4", "data.eval=null",
             "rollout.temperature=1.0", "drift.enabled=false", "train.eval_every=0", "log.tensorboard=false",
             "log.report=false", "log.progress=false"]


def test_shifted_layers_and_padding_routes_stop_an_r3_step_naming_the_cause(tmp_path):
    cfg = load_config("launch/configs/tiny_cpu.yaml", [*OVERRIDES, f"log.run_dir={tmp_path}"])
    shifted, padded = run_ranks(corrupt_routes_worker, 1, cfg.to_dict(), str(tmp_path),
                                ["shifted_layers", "padding_rows"], timeout=600)[0]
    assert shifted["error"] == "LayerOffsetError", shifted
    assert "equal the trainer's layer" in shifted["message"] and "-1 layer off" in shifted["message"], shifted
    assert padded["error"] == "BadRoutes", padded
    assert "rollout engine: routed_experts: row" in padded["message"], padded  # names the engine and the row
    assert "repeats an expert id" in padded["message"] and "padding" in padded["message"], padded
