"""The `train` and `model` sections as the policy sees them."""
from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl.recipes.build import optim_config

DEMO = Path(__file__).resolve().parents[3] / "launch" / "configs" / "tiny_cpu.yaml"


def test_warmup_and_run_length_count_rl_steps():
    """The scheduler steps once per optimizer update: `train.warmup_steps` RL steps of 4 updates
    each are 4x as many scheduler steps, like `train.steps`."""
    cfg = load_config(str(DEMO), ["train.steps=10", "train.warmup_steps=3", "algo.num_minibatches=4"])
    optim = optim_config(cfg, cfg.algo.num_minibatches)
    assert (optim.warmup_steps, optim.total_steps) == (12, 40)


def test_aux_loss_coef_defaults_to_the_checkpoint_and_takes_an_override():
    assert load_config(str(DEMO)).model.moe_aux_loss_coef is None
    assert load_config(str(DEMO), ["model.moe_aux_loss_coef=0.001"]).model.moe_aux_loss_coef == 0.001
    with pytest.raises(ConfigError, match="moe_aux_loss_coef"):
        load_config(str(DEMO), ["model.moe_aux_loss_coef=-1"])
