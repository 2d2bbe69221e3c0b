"""Preference pairs from JSONL / parquet (text, chat, ids), bad rows with file:line, toy preference tasks."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_rl.data import DataError, ToyTokenizer
from moe_rl.data.preference import load_preference_dataset, toy_preference_pairs
from moe_rl.data.toy import make_toy_examples


class ChatTokenizer:
    """One id per character, BOS = 1, EOS = 2, and a visible chat template."""

    chat_template = "{{ messages }}"
    eos_token_id = 2

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        assert tokenize is False
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_text_chat_and_id_rows(tmp_path):
    rows = [{"prompt": "2+2?", "chosen": "4", "rejected": "5", "id": "q1"},
            {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "yo"}],
             "rejected": [{"role": "assistant", "content": "no"}]},
            {"prompt_ids": [7, 8], "chosen_ids": [9], "rejected_ids": [10, 11]}]
    ds = load_preference_dataset(_jsonl(tmp_path / "p.jsonl", rows), ChatTokenizer())
    text, chat, ids = ds
    assert text.uid == "q1" and text.prompt_ids == [1, *map(ord, "2+2?")]
    assert text.chosen_ids == [ord("4"), 2] and text.rejected_ids == [ord("5"), 2]  # EOS ends a text response
    prompt_text = "<user>hi</><assistant>"
    assert chat.prompt_ids == [ord(c) for c in prompt_text]  # the template's generation prompt, no BOS added
    # the response is the rest of the rendered conversation: "<user>hi</><assistant>yo</>" after the prompt
    assert chat.chosen_ids == [ord(c) for c in "yo</>"] and chat.rejected_ids == [ord(c) for c in "no</>"]
    assert ids.prompt_ids == [7, 8] and ids.chosen_ids == [9] and ids.rejected_ids == [10, 11]
    chosen, rejected = ids.sequences()
    assert chosen.tolist() == [7, 8, 9] and rejected.tolist() == [7, 8, 10, 11]


def test_chat_template_that_does_not_extend_the_prompt_is_a_row_error(tmp_path):
    # the prompt renders as "<user>hi</><assistant>", the conversation as "<user>hi</><bot>yo</>"
    row = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "bot", "content": "yo"}],
           "rejected": [{"role": "bot", "content": "no"}]}
    with pytest.raises(DataError, match=r"p.jsonl:1: .*without the rendered prompt"):
        load_preference_dataset(_jsonl(tmp_path / "p.jsonl", [row]), ChatTokenizer())


def test_bad_rows_name_file_and_line(tmp_path):
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"},
            {"prompt": "a", "chosen": "b"},
            "not json",
            {"prompt_ids": [1], "chosen_ids": [], "rejected_ids": [2]},
            {"prompt": "a", "chosen": "b", "rejected": "b"},
            {"prompt": "a", "chosen": 3, "rejected": "c"}]
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as e:
        load_preference_dataset(path, ChatTokenizer())
    lines = e.value.problems
    assert lines[0].startswith(f"{path}:2: missing 'rejected'")
    assert lines[1].startswith(f"{path}:3: invalid JSON")
    assert lines[2].startswith(f"{path}:4: 'chosen_ids' must be a non-empty list")
    assert lines[3].startswith(f"{path}:5: 'chosen' and 'rejected' are the same")
    assert lines[4].startswith(f"{path}:6: 'chosen' must be a non-empty string")
    assert len(lines) == 5


def test_parquet_and_length_limit(tmp_path):
    rows = [{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5, 6]},
            {"prompt_ids": [1], "chosen_ids": [3], "rejected_ids": [4]}]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds = load_preference_dataset(str(path), None, max_len=4)
    assert len(ds) == 1 and ds.num_skipped == 1 and ds[0].prompt_ids == [1]
    with pytest.raises(DataError, match="all 2 pairs are longer than 1 tokens"):
        load_preference_dataset(str(path), None, max_len=1)


def test_toy_preferences_are_right_vs_wrong_with_disjoint_eval_pairs():
    tok = ToyTokenizer()
    train, held = toy_preference_pairs("pref-add-medium"), toy_preference_pairs("pref-add-medium-eval")
    answers = {f"{ex.prompt_text}": ex.answer for ex in make_toy_examples("add-medium")}
    assert len(train) == 25 * 6 and len(held) == 25 * 3  # 9 wrong one-digit answers per problem
    for p in train + held:
        prompt = tok.decode(p.prompt_ids[1:])
        assert tok.decode(p.chosen_ids) == answers[prompt] + "<eos>"
        assert tok.decode(p.rejected_ids) != answers[prompt] + "<eos>" and p.rejected_ids[-1] == tok.eos_token_id
    key = lambda p: (tuple(p.prompt_ids), tuple(p.rejected_ids))  # noqa: E731
    assert not {key(p) for p in train} & {key(p) for p in held}
    assert toy_preference_pairs("pref-add-medium") == train  # deterministic
    ds = load_preference_dataset("toy:pref-add-medium-eval")
    assert isinstance(ds.tokenizer, ToyTokenizer) and len(ds) == 75
    with pytest.raises(DataError, match="not a preference task"):
        load_preference_dataset("toy:add-easy")
    with pytest.raises(DataError, match="unknown toy task"):
        load_preference_dataset("toy:pref-nope")
