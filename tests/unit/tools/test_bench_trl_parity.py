"""The TRL comparison section: registered in `make bench`, its counting, its tokenizer, its table."""
from __future__ import annotations

import pytest


def test_registered(bench):
    assert "trl" in [key for key, _, _ in bench["run_all"].sections()]


def test_summary_counts_up_to_the_first_generation_at_target(bench):
    t = bench["trl_parity"]
    per_gen = t.PROMPTS * t.SAMPLES
    s = t.summarise([0.1, 0.85, 0.5, 0.9], [2.0, 3.0, 4.0, 5.0], 0.8)
    assert (s["reached"], s["generations"], s["samples"], s["seconds"]) == (True, 2, 2 * per_gen, 3.0)
    assert s["s_per_generation"] == pytest.approx(1.0)  # steady rate: the first generation left out
    miss = t.summarise([0.1, 0.2], [1.0, 4.0], 0.8)
    assert (miss["reached"], miss["samples"], miss["seconds"], miss["best"]) == (False, None, None, 0.2)


def test_table_without_trl_says_so(bench):
    t = bench["trl_parity"]
    text = t.format_table({"moe_rl (fast)": [t.summarise([0.9], [1.0], 0.8)]}, ["fast"], 0.8, [1])
    assert "TRL is not installed" in text and "| moe_rl (fast) | 1/1 | 1.0 |" in text


def test_ratio_line_takes_the_median_of_the_per_seed_ratios(bench):
    t = bench["trl_parity"]
    trl = [t.summarise([0.1, 0.9], [1.0, 2.0], 0.8) | {"version": "v"}] * 3
    ours = [t.summarise([0.1, 0.2, 0.9], [1.0, 1.5, 2.0], 0.8),   # time 1.00, samples 1.5, per generation 0.50
            t.summarise([0.9, 0.1], [4.0, 5.0], 0.8),             # time 2.00
            t.summarise([0.1, 0.2], [1.0, 9.0], 0.8)]             # never reached: counts as the largest
    text = t.format_table({t.TRL: trl, "moe_rl (fast)": ours}, ["fast"], 0.8, [1, 2, 3])
    assert "time to 0.8 **2.00**" in text and "Time ratio per seed: 1: 1.00; 2: 2.00; 3: not reached." in text
    assert "| moe_rl (fast) | 2/3 | 4.0 |" in text  # median of 2.0, 4.0 and a miss (counted as the largest)
    one = t.format_table({t.TRL: trl[:1], "moe_rl (fast)": ours[:1]}, ["fast"], 0.8, [1])
    assert "time to 0.8 **1.00**; samples 1.50; seconds per generation **0.50**" in one


def test_toy_tokenizer_matches_the_toy_tokenizer(bench):
    pytest.importorskip("tokenizers")
    from moe_rl.data.toy import ToyTokenizer

    hf = bench["trl_parity"].toy_hf_tokenizer()
    text = "<bos>12+7="
    assert hf(text, add_special_tokens=False)["input_ids"] == ToyTokenizer().encode(text)
    assert (hf.eos_token_id, hf.pad_token_id) == (ToyTokenizer.eos_token_id, ToyTokenizer.pad_token_id)
