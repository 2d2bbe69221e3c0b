"""tools/bench/weight_sync_cost.py: the tensor inventory against checkpoints transformers writes, the byte
and message accounting on a layout small enough to count by hand, the layouts as the shipped configs give
them, and the fit of measured rows against rows made from known constants."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def wsc(bench):
    return bench["weight_sync_cost"]


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    out = {}
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            out |= {k: tuple(s.get_slice(k).get_shape()) for k in s.keys()}
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_dense_layer", "deepseek_v3"])
def test_inventory_is_the_checkpoint_transformers_writes(wsc, tmp_path, family):
    """Every tensor of a tiny model's saved checkpoint, with its shape, and nothing else: the inventory
    built from the same config.json."""
    from moe_rl.testing import TinyMoEConfig, make_tiny_deepseek_v3, make_tiny_qwen3_moe

    if family == "deepseek_v3":
        make_tiny_deepseek_v3(tmp_path)
    else:
        make_tiny_qwen3_moe(tmp_path, config=TinyMoEConfig(mlp_only_layers=[1] if family.endswith("layer") else []))
    config = json.loads((tmp_path / "config.json").read_text())
    saved = _checkpoint_shapes(tmp_path)
    tensors = wsc.inventory(config)
    assert len(tensors) == len({t.name for t in tensors})
    assert {t.name: t.shape for t in tensors} == saved
    assert sum(t.nbytes for t in tensors) == 2 * sum(math.prod(s) for s in saved.values())


def test_inventory_totals_match_the_published_parameter_counts(wsc):
    for model, published in wsc.PUBLISHED_PARAMS.items():
        params = sum(t.numel for t in wsc.inventory(wsc.MODELS[model]))
        assert abs(params / published - 1) <= 0.02, (model, params)


def test_layouts_are_read_from_the_shipped_configs(wsc):
    for name in wsc.FLAGSHIPS:
        path = REPO / "launch" / "configs" / name
        raw = yaml.safe_load(path.read_text())
        layout = wsc.layout_from_config(path)
        sizes = ("tp", "pp", "ep", "etp")
        assert tuple(getattr(layout, k) for k in sizes) == tuple(raw["parallel"][k] for k in sizes)
        assert (layout.num_servers, layout.server_tp) == (raw["rollout"]["num_servers"], raw["rollout"]["tp_size"])
        assert layout.model in wsc.MODELS and layout.model == Path(raw["model"]["hf_path"]).name
        # the world size the config's own comment gives
        assert layout.world == int(re.search(r"(\d+) trainer GPUs", path.read_text()).group(1))
        layers = wsc.MODELS[layout.model]["num_hidden_layers"]
        stages = layout.stage_of_layer(layers)
        counts = [stages.count(s) for s in range(layout.pp)]
        assert sum(counts) == layers and stages == sorted(stages)
        for key, at in (("first_stage_layers", 0), ("last_stage_layers", -1)):
            if raw["parallel"].get(key):
                assert counts[at] == raw["parallel"][key]


def test_the_235b_config_loads_and_its_layout_fits_the_published_model(wsc):
    from moe_rl.config import load_config
    from moe_rl.policy.model import arch_from_hf_dict
    from moe_rl.policy.parallel import ParallelLayout

    path = REPO / "launch" / "configs" / "qwen3_235b_a22b_gspo.yaml"
    cfg = load_config(path)
    cfg.validate()
    arch = arch_from_hf_dict({"architectures": ["Qwen3MoeForCausalLM"], "num_experts_per_tok": 8,
                              "norm_topk_prob": True, "rope_theta": 1000000, **wsc.MODELS["Qwen3-235B-A22B"]})
    layout = ParallelLayout.of(cfg.parallel, wsc.layout_from_config(path).world).validate(arch)
    assert layout.world_size // layout.pp % (layout.ep * layout.etp) == 0 and cfg.algo.replay == "r3"


def test_bytes_and_messages_on_a_layout_counted_by_hand(wsc):
    """tp2 pp2 ep2 on 4 ranks (one node), 3 servers of tp2, buckets larger than the model: rank 0 and 2
    own their stage's dense tensors and EP rank 0's experts, ranks 1 and 3 EP rank 1's experts."""
    V, H, L, heads, kv, hd, E, inter = 128, 64, 4, 4, 2, 16, 4, 32
    config = dict(model_type="qwen3_moe", vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=hd, num_experts=E, moe_intermediate_size=inter,
                  tie_word_embeddings=False)
    layout = wsc.Layout(config="hand", model="tiny", tp=2, pp=2, ep=2, etp=1, world=4, num_servers=3, server_tp=2)
    a = wsc.Assumptions()
    tensors = wsc.inventory(config)

    split_attn = (heads * hd * H + 2 * kv * hd * H + H * heads * hd) * 2   # q, k, v, o: TP-split
    dense_layer = split_attn + (2 * H + 2 * hd + E * H) * 2                 # + 2 norms, q/k norms, router
    expert = 3 * inter * H * 2
    stage0 = V * H * 2 + 2 * dense_layer                                    # embedding + layers 0, 1
    stage1 = 2 * dense_layer + H * 2 + V * H * 2                            # layers 2, 3 + norm + lm_head
    experts_share = 2 * 2 * expert                                          # 2 layers x 2 experts
    model = stage0 + stage1 + 4 * experts_share
    assert sum(t.nbytes for t in tensors) == model

    owners = wsc.shares(tensors, config, layout)
    assert {r: s.nbytes for r, s in owners.items()} == {0: stage0 + experts_share, 1: experts_share,
                                                        2: stage1 + experts_share, 3: experts_share}
    assert owners[2].gather_in_bytes == (2 * split_attn + V * H * 2) / 2   # half of what it gathers comes in
    # qkv and o of each layer, + the embedding / lm_head
    assert [owners[r].gathers for r in range(4)] == [1 + 2 * 2, 0, 2 * 2 + 1, 0]

    src = wsc.estimate(tensors, config, layout, "sources", "full", a)
    assert src.busiest_rank == 2 and src.busiest_sent == 3 * (stage1 + experts_share)
    # a bucket per source and rank 0's last word; HTTP also begin, end, verify
    assert src.server_gpu_in == model and src.groups_per_server_gpu == 4 and src.buckets_per_server == 5
    assert src.http_per_server == 5 + 3 and src.http_total == 3 * 8
    assert src.collectives == 10 + 5 * 3                              # gathers + each bucket to each server
    assert src.peak_extra == 2 * (stage1 + experts_share)
    serialized = 5 * (a.http_rtt_s + a.launch_s) + 3 * a.http_rtt_s
    links = [src.busiest_sent / (a.nic_gbps * 1e9), model / (a.nic_gbps * 1e9), model / (a.nvlink_gbps * 1e9),
             model / (a.hbm_gbps * 1e9)]
    assert src.seconds == pytest.approx(max(links) + serialized)

    fun = wsc.estimate(tensors, config, layout, "funnel", "full", a)
    own = stage0 + experts_share
    rank0_tensors = 1 + 2 * 9 + 2 * 2 * 3                                  # embedding, 2 layers' 9 dense, 12 expert
    assert fun.busiest_rank == 0 and fun.busiest_sent == model
    assert fun.busiest_received == model - own + owners[0].gather_in_bytes
    assert fun.collectives == (len(tensors) - rank0_tensors) + 1 + 10   # p2p + one bucket + gathers
    assert fun.http_per_server == 1 + 2 and fun.groups_per_server_gpu == 1  # its bucket; begin, end
    assert fun.peak_extra == own + 3 * model
    assert fun.links["rank 0 NIC in"] == 0                               # all four ranks share a node

    f = 0.1  # changed values: an int32 index and a bf16 value each, 6 f bytes per element
    delta = wsc.estimate(tensors, config, layout, "sources", "delta", a, f)
    assert delta.server_gpu_in == pytest.approx(model / 2 * 6 * f)
    assert delta.busiest_sent == pytest.approx(3 * (stage1 + experts_share) / 2 * 6 * f)
    assert delta.http_per_server == 5 + 4                                # + the version each server holds
    assert wsc.estimate(tensors, config, layout, "sources", "delta", a, 0.5).server_gpu_in == model  # whole is smaller
    # changed tensors whole (SGLang): a tensor of n values is sent with probability 1 - (1 - f)^n
    whole = wsc.estimate(tensors, config, layout, "sources", "delta", wsc.replace(a, delta_encoding="tensor"), f)
    assert whole.server_gpu_in == pytest.approx(sum(t.nbytes * (1 - (1 - f) ** t.numel) for t in tensors))


def test_buckets_are_greedy_and_a_big_tensor_gets_its_own(wsc):
    assert wsc.buckets([3, 3, 3, 5, 1], 6) == [6, 3, 6]
    assert wsc.buckets([10, 2], 6) == [10, 2]
    assert wsc.buckets([], 6) == []


def _rows(a, b, c):
    """Rows whose push_s is exactly a + b * bytes + c * messages; busiest bytes ~ model / ranks."""
    rows = []
    for path in ("funnel", "sources"):
        for mode in ("full", "delta"):
            for ranks in (2, 4, 8):
                for model in (1e7, 3e7, 9e7):
                    busiest = model / ranks * (1 if mode == "full" else 0.09)
                    messages = 50 * ranks + model / 1e6 * (3 if path == "funnel" else 1)
                    rows.append(dict(path=path, mode=mode, ranks=ranks, layout=f"ep{ranks}", experts=8,
                                     model_bytes=model, busiest_rank_bytes=busiest, messages_per_push=messages,
                                     buckets=1, push_s=a + b * busiest + c * messages, peak_rss_mb=1.0,
                                     delta_bytes=0, verified=True))
    return rows


def test_fit_recovers_the_constants_and_slopes(wsc):
    rows = _rows(0.02, 3e-9, 4e-5)
    for path in ("funnel", "sources"):
        fit = wsc.fit_linear([r for r in rows if r["path"] == path])
        assert (fit["a"], fit["b"], fit["c"]) == pytest.approx((0.02, 3e-9, 4e-5), rel=1e-6)
        assert fit["r2"] == pytest.approx(1.0)
    slopes = wsc.loglog_slopes([r for r in rows if (r["path"], r["mode"]) == ("sources", "full")], "busiest_rank_bytes")
    assert slopes == pytest.approx({"model_bytes": 1.0, "ranks": -1.0})
    same_ranks = [r for r in rows if r["ranks"] == 4 and r["path"] == "funnel" and r["mode"] == "full"]
    assert wsc.loglog_slopes(same_ranks, "busiest_rank_bytes")["ranks"] is None


def test_json_rows_are_fitted_and_unverified_rows_left_out(wsc, tmp_path, capsys):
    rows = _rows(0.02, 3e-9, 4e-5)
    rows.append(dict(rows[0], push_s=1e3, verified=False))
    (tmp_path / "rows.json").write_text(json.dumps({"rows": rows}))
    assert wsc.main(["--json", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    assert "1 unverified rows left out" in out and out.count("R^2 = 1.0000") == 2
    assert "Assumptions" in out and "nic_gbps = 50.0" in out


def test_markdown_sets_estimates_beside_the_published_numbers(wsc, capsys):
    assert wsc.main(["--markdown"]) == 0
    out = capsys.readouterr().out
    assert "estimate" in out
    for number in ("0.74-1.0", "2.4-2.8", "~2", "2.16", "3.16", "7.2", "11-15", "246-266"):
        assert number in out
    for model in ("Qwen3-30B-A3B", "Qwen3-235B-A22B", "DeepSeek-V3"):
        verdicts = [line for line in out.splitlines() if line.startswith(f"- {model}, sources")]
        assert len(verdicts) == 2 and all(("meets" in v or "misses" in v) and "binds" in v for v in verdicts)
