"""The TRL comparison sections: registered in `make bench`, presets, counting, tokenizer, tables."""
from __future__ import annotations

import argparse

import pytest


def test_registered(bench):
    keys = [key for key, _, _ in bench["run_all"].sections()]
    assert "trl" in keys and "trl_extended" in keys


def test_presets(bench):
    t = bench["trl_parity"]
    (demo,) = t.PRESETS["demo"]
    assert (demo.task, demo.prompts, demo.samples, demo.new_tokens, demo.updates, demo.lr) == ("add-easy", 9, 16, 1, 2, 1e-3)
    ext = t.PRESETS["extended"]
    assert [s.lr for s in ext] == [1e-3, 3e-3]
    assert {(s.task, s.prompts, s.samples, s.new_tokens, s.updates) for s in ext} == {("last-parity", 32, 8, 2, 4)}
    assert "data.shuffle_seed=7" in t.common(demo, 7) and "model.seed=7" in t.common(demo, 7)  # seed: prompts too


def test_command_line_changes_every_setting_of_the_preset(bench):
    t = bench["trl_parity"]
    args = argparse.Namespace(preset="extended", task=None, lr=[3e-3], samples=None, new_tokens=None, updates=None,
                              max_generations=50)
    (one,) = t.settings_from(args)  # both preset settings become the same one: kept once
    assert (one.lr, one.max_generations, one.task) == (3e-3, 50, "last-parity")
    args.lr, args.task = [1e-3, 1e-2], "add-medium"
    assert [(s.task, s.lr) for s in t.settings_from(args)] == [("add-medium", 1e-3), ("add-medium", 1e-2)]


def test_trl_config_is_the_same_run(bench):
    pytest.importorskip("trl")
    t = bench["trl_parity"]
    s = t.PRESETS["extended"][1]
    cfg = t.trl_config(s, "/nonexistent", 3, {"lr_scheduler_type": "linear"})
    assert (cfg.per_device_train_batch_size * cfg.steps_per_generation, cfg.num_generations) == (32 * 8, 8)
    assert (cfg.max_completion_length, cfg.learning_rate, cfg.epsilon, cfg.epsilon_high) == (2, 3e-3, 3e-4, 4e-4)
    assert cfg.lr_scheduler_type == "linear" and cfg.seed == 3


def test_summary_counts_up_to_the_first_generation_at_target(bench):
    t = bench["trl_parity"]
    per_gen = 144
    s = t.summarise([0.1, 0.85, 0.5, 0.9], [2.0, 3.0, 4.0, 5.0], 0.8, per_gen)
    assert (s["reached"], s["generations"], s["samples"], s["seconds"]) == (True, 2, 2 * per_gen, 3.0)
    assert s["s_per_generation"] == pytest.approx(1.0)  # steady rate: the first generation left out
    assert s["curve"] == [0.1, 0.85, 0.5, 0.9]
    miss = t.summarise([0.1, 0.2], [1.0, 4.0], 0.8, per_gen)
    assert (miss["reached"], miss["generations"], miss["samples"], miss["seconds"], miss["best"]) == \
        (False, 2, None, None, 0.2)


def test_table_without_trl_says_so(bench):
    t = bench["trl_parity"]
    text = t.format_table({"moe_rl (fast)": [t.summarise([0.9], [1.0], 0.8, 144)]}, ["fast"], 0.8, [1])
    assert "TRL is not installed" in text and "| moe_rl (fast) | 1/1 | 1 | 1 | 144 | 1.0 |" in text


def test_ratio_line_takes_the_median_of_the_per_seed_ratios(bench):
    t = bench["trl_parity"]
    trl = [t.summarise([0.1, 0.9], [1.0, 2.0], 0.8, 144) | {"version": "v"}] * 3
    ours = [t.summarise([0.1, 0.2, 0.9], [1.0, 1.5, 2.0], 0.8, 144),  # time 1.00, samples 1.5, per generation 0.50
            t.summarise([0.9, 0.1], [4.0, 5.0], 0.8, 144),            # time 2.00
            t.summarise([0.1, 0.2], [1.0, 9.0], 0.8, 144)]            # never reached: counts as the largest
    text = t.format_table({t.TRL: trl, "moe_rl (fast)": ours}, ["fast"], 0.8, [1, 2, 3])
    assert "time to 0.8 **2.00**" in text and "Time ratio per seed: 1: 1.00; 2: 2.00; 3: not reached." in text
    # generations 3, 1 and a miss: median 3 against TRL's 2; per seed, a miss shows its generations
    assert "| moe_rl (fast) | 2/3 | 3 | 3, 1, -(2) | 432 | 4.0 |" in text
    assert "median generations to 0.8 **1.50**" in text
    one = t.format_table({t.TRL: trl[:1], "moe_rl (fast)": ours[:1]}, ["fast"], 0.8, [1])
    assert "time to 0.8 **1.00**, samples 1.50, seconds per generation **0.50**" in one


def test_toy_tokenizer_matches_the_toy_tokenizer(bench):
    pytest.importorskip("tokenizers")
    from moe_rl.data.toy import ToyTokenizer

    hf = bench["trl_parity"].toy_hf_tokenizer()
    text = "<bos>12+7="
    assert hf(text, add_special_tokens=False)["input_ids"] == ToyTokenizer().encode(text)
    assert (hf.eos_token_id, hf.pad_token_id) == (ToyTokenizer.eos_token_id, ToyTokenizer.pad_token_id)
