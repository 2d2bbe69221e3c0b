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
    text = t.format_table({"moe_rl (fast)": t.summarise([0.9], [1.0], 0.8)}, ["fast"], 0.8)
    assert "TRL is not installed" in text and "| moe_rl (fast) | 1.0 |" in text


def test_ratio_line(bench):
    t = bench["trl_parity"]
    results = {"TRL GRPOTrainer": t.summarise([0.1, 0.9], [1.0, 2.0], 0.8) | {"version": "v"},
               "moe_rl (fast)": t.summarise([0.1, 0.2, 0.9], [1.0, 1.5, 2.0], 0.8)}
    text = t.format_table(results, ["fast"], 0.8)
    assert "time to 0.8: **1.00**; samples: 1.50; seconds per generation: **0.50**" in text


def test_toy_tokenizer_matches_the_toy_tokenizer(bench):
    pytest.importorskip("tokenizers")
    from moe_rl.data.toy import ToyTokenizer

    hf = bench["trl_parity"].toy_hf_tokenizer()
    text = "<bos>12+7="
    assert hf(text, add_special_tokens=False)["input_ids"] == ToyTokenizer().encode(text)
    assert (hf.eos_token_id, hf.pad_token_id) == (ToyTokenizer.eos_token_id, ToyTokenizer.pad_token_id)
