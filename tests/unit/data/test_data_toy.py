"""Toy tokenizer and toy tasks: vocabulary, round trips, determinism, correct answers."""
from __future__ import annotations

import pytest

from moe_rl.data import (DataError, ToyTokenizer, chance_level, load_dataset, make_toy_examples,
                         toy_task_names)

TASKS = ["add-easy", "add-medium", "add-hard"]


def test_vocabulary_and_special_ids():
    tok = ToyTokenizer()
    assert tok.vocab_size == len(tok) == 16
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert sorted(set(tok.encode("0123456789+-=<pad><bos><eos>"))) == list(range(16))


@pytest.mark.parametrize("text", ["1+2=3", "<bos>9+9=18<eos>", "-", "<pad><pad>"])
def test_round_trip(text):
    tok = ToyTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_encode_details():
    tok = ToyTokenizer()
    assert tok.encode(" 1 + 2 =") == tok.encode("1+2=")  # whitespace carries no token
    assert tok.encode("1", add_special_tokens=True) == [tok.bos_token_id] + tok.encode("1")
    assert tok.decode(tok.encode("<bos>3<eos>"), skip_special_tokens=True) == "3"
    with pytest.raises(ValueError, match="'x' at position 1"):
        tok.encode("1x")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([16])


@pytest.mark.parametrize("task", TASKS)
def test_answers_are_sums(task):
    for ex in make_toy_examples(task):
        a, b = ex.prompt_text.rstrip("=").split("+")
        assert ex.answer == str(int(a) + int(b)) and ex.metadata == {"a": int(a), "b": int(b)}


def test_last_parity_covers_every_three_digit_input_once():
    examples = make_toy_examples("last-parity")
    assert sorted(ex.prompt_text for ex in examples) == [f"{n:03d}=" for n in range(1000)]
    for ex in examples:
        digits = ex.prompt_text.rstrip("=")
        assert ex.answer == str(int(digits[2]) % 2)
        assert ex.metadata == {"a": int(digits[0]), "b": int(digits[1]), "c": int(digits[2])}
    assert sum(ex.answer == "1" for ex in examples) == 500  # a constant answer scores 1/2
    train, ev = make_toy_examples("last-parity"), make_toy_examples("last-parity-eval")
    assert train == make_toy_examples("last-parity") and [e.prompt_text for e in train] != [e.prompt_text for e in ev]
    assert load_dataset("toy:last-parity")[0].prompt_ids[1:] == ToyTokenizer().encode(train[0].prompt_text)


def test_echo_tail_answers_have_a_long_tailed_length():
    examples = make_toy_examples("echo-tail")
    assert sorted(ex.prompt_text for ex in examples) == [f"{n:02d}=" for n in range(100)]
    lengths = sorted(len(ex.answer) for ex in examples)
    for ex in examples:
        a, b = ex.metadata["a"], ex.metadata["b"]
        assert ex.prompt_text == f"{a}{b}=" and set(ex.answer) == {str(a)}
    # 30% one token, 10% 32 tokens: the median is 2.5 tokens, the mean 6.4, the longest 13x the median
    assert lengths.count(1) == 30 and lengths.count(32) == 10 and sum(lengths) == 640
    assert chance_level("echo-tail", 1) == pytest.approx(0.3 / 16)  # the one-token answers alone
    assert [e.prompt_text for e in make_toy_examples("echo-tail-eval")] != [e.prompt_text for e in examples]


def test_tasks_are_deterministic_and_eval_is_reordered():
    assert {f"{t}{s}" for t in TASKS for s in ("", "-eval")} <= set(toy_task_names())
    for task in TASKS:
        train, again, ev = (make_toy_examples(n) for n in (task, task, f"{task}-eval"))
        assert train == again
        assert sorted(e.prompt_text for e in train) == sorted(e.prompt_text for e in ev)
        assert [e.prompt_text for e in train] != [e.prompt_text for e in ev]
    assert [len(make_toy_examples(t)) for t in TASKS] == [9, 25, 100]


def test_toy_dataset_prompts():
    ds = load_dataset("toy:add-easy")
    tok = ds.tokenizer
    assert isinstance(tok, ToyTokenizer) and len(ds) == 9
    p = ds[0]
    assert p.prompt_ids[0] == tok.bos_token_id and tok.decode(p.prompt_ids[1:]) == p.prompt_text
    assert p.uid == "add-easy:0" and p.metadata["task"] == "add-easy"
    assert max(max(p.prompt_ids) for p in load_dataset("toy:add-hard")) < tok.vocab_size


def test_unknown_toy_task_lists_known():
    with pytest.raises(DataError, match="unknown toy task 'add-huge'.*add-easy"):
        load_dataset("toy:add-huge")


def test_chance_levels():
    assert chance_level("add-easy", 1) == pytest.approx(1 / 16)
    assert chance_level("add-easy", 2) == pytest.approx(1 / 256)
    assert chance_level("add-easy", 64) == pytest.approx(1 / 256)
    assert chance_level("add-hard", 1) == pytest.approx(0.55 / 16)
    assert chance_level("add-hard", 3) == pytest.approx(0.55 / 256 + 0.45 / 16**3)
    assert chance_level("last-parity", 1) == pytest.approx(1 / 16)
    assert chance_level("last-parity", 2) == pytest.approx(1 / 256)


def test_the_toy_tokenizer_saved_for_hf_encodes_and_decodes_as_the_toy_one(tmp_path):
    import random

    from transformers import AutoTokenizer

    from moe_rl.data.toy import TOY_TOKENS, ToyTokenizer, save_toy_tokenizer

    hf, toy = AutoTokenizer.from_pretrained(str(save_toy_tokenizer(tmp_path))), ToyTokenizer()
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    rng = random.Random(0)
    pieces = list(TOY_TOKENS) + [" ", "  ", "\n"]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert hf.encode(text, add_special_tokens=False) == toy.encode(text), text
        assert hf.encode(text) == toy.encode(text, add_special_tokens=True), text
        ids = toy.encode(text)
        assert hf.decode(ids) == toy.decode(ids), text


def test_a_fresh_tiny_model_of_the_toy_alphabet_is_written_with_its_tokenizer(tmp_path):
    """A run's init_model (and so its export, which copies the tokenizer files) loads with
    AutoTokenizer, and as model.hf_path its text rows encode as the toy tokenizer encodes them."""
    from types import SimpleNamespace

    from moe_rl.config import load_config
    from moe_rl.data.toy import ToyTokenizer
    from moe_rl.recipes.build import initial_model, run_tokenizer

    cfg = load_config("launch/configs/tiny_cpu.yaml")
    path = initial_model(cfg, tmp_path, 0, SimpleNamespace(tokenizer=ToyTokenizer()))
    again = run_tokenizer(load_config("launch/configs/tiny_cpu.yaml", [f"model.hf_path={path}"]))
    assert type(again).__name__ != "ToyTokenizer" and again.encode("12+3=", add_special_tokens=False) == \
        ToyTokenizer().encode("12+3=")
