"""`moe-rl drift` end to end on tiny checkpoints, through the CLI dispatcher in-process."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from moe_rl.cli import main


@pytest.fixture(scope="module")
def noisy_router_dir(tiny_hf_dir, tmp_path_factory):
    """The tiny checkpoint with small Gaussian noise on the router weights (`mlp.gate.weight`) only."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("noisy_router")
    shutil.copytree(tiny_hf_dir, out, dirs_exist_ok=True)
    weights = load_file(str(tiny_hf_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    gates = [k for k in weights if k.endswith("mlp.gate.weight")]
    assert len(gates) == 4
    for k in gates:  # init std 0.2: noise of 0.02 flips a few close top-2 choices
        weights[k] = weights[k] + 0.02 * torch.randn(weights[k].shape, generator=g)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("drift_data") / "rows.jsonl"
    rows = [{"input_ids": [rng.randrange(3, 128) for _ in range(rng.randrange(4, 30))]} for _ in range(12)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")  # a trailing blank line is fine
    return path, sum(len(r["input_ids"]) - 1 for r in rows)


def _drift(before, after, data, out, *extra) -> int:
    return main(["drift", "--before", str(before), "--after", str(after), "--data", str(data),
                 "--out", str(out), "--batch-size", "5", *extra])


def test_router_noise_changes_routes(tiny_hf_dir, noisy_router_dir, rows_file, tmp_path, capsys):
    data, num_tokens = rows_file
    assert _drift(tiny_hf_dir, noisy_router_dir, data, tmp_path / "r.json") == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    for key in ("layers", "volatility", "exact_match", "tokens_changed_any_layer", "num_tokens", "logprob",
                "load_change", "load_max_share", "metrics"):
        assert key in rep, key
    assert rep["num_tokens"] == num_tokens
    assert [r["layer"] for r in rep["layers"]] == [0, 1, 2, 3]
    assert set(rep["layers"][0]) >= {"layer", "volatility", "exact_match", "load_change"}
    assert rep["volatility"] > 0 and rep["exact_match"] < 1 and rep["tokens_changed_any_layer"] > 0
    assert rep["volatility"] == pytest.approx(sum(r["volatility"] for r in rep["layers"]) / 4)
    assert rep["logprob"]["k3"] > 0
    assert {"drift/volatility", "drift/volatility/layer_03", "drift/logp_k3",
            "drift/load_change/layer_00", "drift/load_max_share"} <= set(rep["metrics"])
    printed = capsys.readouterr().out
    assert "volatility" in printed and "all" in printed


def test_same_checkpoint_gives_exactly_zero(tiny_hf_dir, rows_file, tmp_path):
    data, num_tokens = rows_file
    assert _drift(tiny_hf_dir, tiny_hf_dir, data, tmp_path / "same.json", "--max-rows", "7") == 0
    rep = json.loads((tmp_path / "same.json").read_text())
    assert rep["num_rows"] == 7
    assert rep["volatility"] == 0.0 and rep["exact_match"] == 1.0
    assert rep["tokens_changed_any_layer"] == 0.0 and rep["load_change"] == 0.0
    assert all(r["volatility"] == 0.0 for r in rep["layers"])
    assert rep["logprob"]["abs_diff"] == 0.0 and rep["logprob"]["k3"] == 0.0


def test_bad_row_names_file_and_line(tiny_hf_dir, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n\n{"input_ids": [4, "x"]}\n')
    assert _drift(tiny_hf_dir, tiny_hf_dir, data, tmp_path / "o.json") == 2
    assert f"{data}:3: `input_ids` must be a list of integers" in capsys.readouterr().err
    data.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2\n')
    assert _drift(tiny_hf_dir, tiny_hf_dir, data, tmp_path / "o.json") == 2
    assert f"{data}:2: not valid JSON" in capsys.readouterr().err
    data.write_text('{"input_ids": [1, 2, 300]}\n')
    assert _drift(tiny_hf_dir, tiny_hf_dir, data, tmp_path / "o.json") == 2
    assert f"{data}:1: token ids outside the vocabulary [0, 128): [300]" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_text_rows_without_tokenizer_ask_for_input_ids(tiny_hf_dir, tmp_path, capsys):
    data = tmp_path / "text.jsonl"
    data.write_text('{"prompt": "1 + 1 =", "response": " 2"}\n')
    assert _drift(tiny_hf_dir, tiny_hf_dir, data, tmp_path / "o.json") == 2
    err = capsys.readouterr().err
    assert f"{data}:1:" in err and "no tokenizer" in err and "input_ids" in err


def test_text_rows_use_the_checkpoint_tokenizer(tiny_hf_dir, noisy_router_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "[UNK]"] + [f"w{i}" for i in range(100)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    before = tmp_path / "with_tokenizer"
    shutil.copytree(tiny_hf_dir, before)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<pad>").save_pretrained(before)
    text, ids = tmp_path / "text.jsonl", tmp_path / "ids.jsonl"
    text.write_text('{"prompt": "w1 w2 w3", "response": "w4 w5 w6 w7"}\n{"prompt": "w50 w9", "response": "w8"}\n')
    ids.write_text('{"input_ids": [5, 6, 7, 8, 9, 10, 11]}\n{"input_ids": [54, 13, 12]}\n')
    assert _drift(before, noisy_router_dir, text, tmp_path / "t.json") == 0
    assert _drift(before, noisy_router_dir, ids, tmp_path / "i.json") == 0
    t, i = (json.loads((tmp_path / f).read_text()) for f in ("t.json", "i.json"))
    assert t["num_tokens"] == 6 + 2
    assert t["layers"] == i["layers"] and t["logprob"] == i["logprob"]


def test_checkpoint_errors(tiny_hf_dir, rows_file, tmp_path, capsys):
    data, _ = rows_file
    assert _drift(tmp_path / "nope", tiny_hf_dir, data, tmp_path / "o.json") == 2
    assert "--before" in capsys.readouterr().err
    deeper = tmp_path / "six_layers"
    deeper.mkdir()
    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 6
    (deeper / "config.json").write_text(json.dumps(cfg))
    assert _drift(tiny_hf_dir, deeper, data, tmp_path / "o.json") == 2
    err = capsys.readouterr().err
    assert "architecture mismatch" in err and "num_hidden_layers: 4 vs 6" in err
    more = tmp_path / "eight_experts"
    more.mkdir()
    cfg["num_hidden_layers"], cfg["num_local_experts"] = 4, 8  # Qwen3-MoE saves num_experts under this name
    (more / "config.json").write_text(json.dumps(cfg))
    assert _drift(tiny_hf_dir, more, data, tmp_path / "o.json") == 2
    assert "num_experts: 4 vs 8" in capsys.readouterr().err
