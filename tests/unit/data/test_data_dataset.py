"""Loading prompt datasets from JSONL and parquet: prompt forms, metadata, bad rows, length limit."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_rl.data import DataError, ToyTokenizer, load_dataset


class CharTokenizer:
    """One id per character (BOS = 1 when special tokens are added) and a visible chat template."""

    chat_template = "{{ messages }}"

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


ROWS = [
    {"prompt": "What is 2+2?", "answer": "4", "source": "a"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
     "answer": 2, "id": "q7"},
    {"input_ids": [5, 6, 7], "answer": "x"},
]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    # a parquet column has one type: numeric answers are stored as text here
    rows = [{**r, "answer": str(r["answer"])} if "answer" in r else r for r in rows]
    keys = list(dict.fromkeys(k for r in rows for k in r))  # from_pylist reads keys of row 1 only
    rows = [{k: r.get(k) for k in keys} for r in rows]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize("writer,name", [(write_jsonl, "d.jsonl"), (write_parquet, "d.parquet")])
def test_three_prompt_forms(tmp_path, writer, name):
    ds = load_dataset(writer(tmp_path / name, ROWS), CharTokenizer())
    plain, chat, ids = ds
    assert plain.prompt_text == "What is 2+2?" and plain.prompt_ids[0] == 1  # specials added
    assert plain.answer == "4" and plain.metadata["source"] == "a" and plain.uid == f"{name}:1"
    assert chat.prompt_text == "<system>Be brief.<user>1+1?<assistant>"
    assert chat.prompt_ids == [ord(c) for c in chat.prompt_text]  # the template holds the specials
    assert chat.answer == "2" and chat.uid == "q7" and "messages" not in chat.metadata
    assert ids.prompt_ids == [5, 6, 7] and ids.prompt_text == "\x05\x06\x07"
    assert ids.metadata == {}  # the used fields are not metadata, nor are parquet's null fillers


def test_custom_keys_and_missing_answer(tmp_path):
    path = write_jsonl(tmp_path / "k.jsonl", [{"question": "1+2=", "solution": "3"}, {"question": "2+2="}])
    ds = load_dataset(path, ToyTokenizer(), prompt_key="question", answer_key="solution")
    assert [p.answer for p in ds] == ["3", None]
    assert ds[0].prompt_ids == ToyTokenizer().encode("<bos>1+2=")


def test_input_ids_work_without_a_tokenizer(tmp_path):
    ds = load_dataset(write_jsonl(tmp_path / "i.jsonl", [{"input_ids": [1, 2]}, "", {"input_ids": [3]}]))
    assert [p.prompt_ids for p in ds] == [[1, 2], [3]] and ds[1].uid == "i.jsonl:3"  # blank line 2


def test_bad_rows_name_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "ok", "answer": "1"},
        '{"prompt": "unterminated',
        {"answer": "2"},
        {"prompt": 5},
        '["a", "list"]',
        {"messages": [{"role": "user"}]},
        {"prompt": "fine", "answer": ["a"]},
        {"input_ids": [1, -2]},
    ])
    with pytest.raises(DataError) as err:
        load_dataset(path, CharTokenizer())
    lines = err.value.problems
    assert lines[0].startswith(f"{path}:2: invalid JSON")
    assert lines[1].startswith(f"{path}:3: no prompt: expected a 'prompt', 'messages' or 'input_ids'")
    assert lines[2] == (f"{path}:4: 'prompt' must be a string or a list of {{role, content}} "
                        "messages, got a number")
    assert lines[3] == f"{path}:5: expected a JSON object, got a list"
    assert lines[4].startswith(f"{path}:6: 'messages'[0] must be an object with string 'role' and 'content'")
    assert lines[5].startswith(f"{path}:7: 'answer' must be a string or a number, got a list")
    assert lines[6] == f"{path}:8: 'input_ids' must hold non-negative integers; found -2"
    assert str(err.value).startswith("7 bad rows:")


def test_parquet_rows_are_numbered(tmp_path):
    path = write_parquet(tmp_path / "bad.parquet", [{"prompt": "ok"}, {"prompt": ""}])
    with pytest.raises(DataError, match=r"bad\.parquet: row 2: 'prompt' is an empty string"):
        load_dataset(path, CharTokenizer())


def test_text_needs_a_tokenizer_and_chat_needs_a_template(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1="}])
    with pytest.raises(DataError, match=r"t\.jsonl:1: 'prompt' is text but no tokenizer"):
        load_dataset(path, None)
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "1+1="}]}])
    with pytest.raises(DataError, match=r"c\.jsonl:1: .*needs a tokenizer with a chat template"):
        load_dataset(path, ToyTokenizer())
    path = write_jsonl(tmp_path / "v.jsonl", [{"prompt": "1+a="}])
    with pytest.raises(DataError, match=r"v\.jsonl:1: cannot tokenise 'prompt': .*'a'"):
        load_dataset(path, ToyTokenizer())


def test_long_prompts_are_skipped_and_counted(tmp_path, caplog):
    path = write_jsonl(tmp_path / "l.jsonl", [{"prompt": "1+1="}, {"prompt": "11+11="}, {"prompt": "2="}])
    ds = load_dataset(path, ToyTokenizer(), max_prompt_len=5)
    assert [p.prompt_text for p in ds] == ["1+1=", "2="] and ds.num_skipped == 1
    assert "skipped 1 of 3 prompts longer than max_prompt_len=5" in caplog.text
    with pytest.raises(DataError, match="all 3 prompts are longer than max_prompt_len=2"):
        load_dataset(path, ToyTokenizer(), max_prompt_len=2)


def test_bad_specs(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_dataset(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match="unsupported dataset"):
        load_dataset(str(tmp_path / "data.csv"))
    with pytest.raises(DataError, match="has no rows"):
        load_dataset(write_jsonl(tmp_path / "empty.jsonl", []))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="cannot read as parquet"):
        load_dataset(str(tmp_path / "junk.parquet"))


@pytest.mark.parametrize("bad", [10, 11, 25])
def test_the_bad_row_count_is_the_files_and_a_cut_report_says_so(tmp_path, bad):
    path = str(tmp_path / "rows.jsonl")
    open(path, "w").write("".join('{"answer": "1"}\n' for _ in range(bad)) + '{"prompt": "fine"}\n')
    with pytest.raises(DataError) as err:
        load_dataset(path, CharTokenizer())
    shown = min(bad, 10)
    assert len(err.value.problems) == shown
    assert all(p.startswith(f"{path}:") for p in err.value.problems)
    head = str(err.value).splitlines()[0]
    if bad == 10:  # exactly ten bad rows: the count is exact, and nothing says reading stopped
        assert head == "10 bad rows:" and not err.value.more
    else:
        assert head == "more than 10 bad rows (reading stopped; the first 10):" and err.value.more
