"""The names a weight push sends for Qwen3-Next and Qwen3.5-MoE (the checkpoint's: the export round trip in
tests/distributed/test_families.py is bit-exact under them), through sglang 0.5.23's own `load_weights`.

Importing sglang's model files needs its GPU stack (fla's Triton kernels, einops, a parallel state), so the
loaders are read from the installed source with `ast` and run as they are (`Qwen3NextForCausalLM.load_weights`
in qwen3_next.py; for `Qwen3_5MoeForCausalLM`, the entry class of qwen3_5_text.py, its `load_weights` over the
text body's in qwen3_5.py), with sglang's `FusedMoE.make_expert_params_mapping` and `get_layer_id`, against
the parameters sglang's model holds for the tiny config. Those are listed below by module; each module's
attributes are checked against the `self.X = ...` of its class's `__init__` in the installed source.

A name fails when sglang would raise on it, log it as not found, or skip it without loading it (what its
loaders do with an unknown `.bias`, `_bias` or `mtp` name); every parameter, and every shard of a fused
one (q/k/v, gate/up, each expert's w1/w2/w3, the delta net's qkv/z and b/a), must be loaded.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from moe_rl.policy.convert import HFCheckpoint

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="sglang is not installed (`make venv` installs sglang==0.5.23 --no-deps)")

SRT = Path(importlib.util.find_spec("sglang").origin).parent / "srt" if importlib.util.find_spec("sglang") else None

# sglang's modules and the attributes they hold that carry weights (file, class): attributes.
MODULES = {
    ("models/qwen3_next.py", "Qwen3GatedDeltaNet"): ("in_proj_qkvz", "in_proj_ba", "conv1d", "A_log", "dt_bias",
                                                      "norm", "out_proj"),
    ("models/qwen3_next.py", "Qwen3HybridLinearDecoderLayer"): ("linear_attn", "mlp", "input_layernorm",
                                                                "post_attention_layernorm"),
    ("models/qwen3_next.py", "Qwen3HybridAttentionDecoderLayer"): ("qkv_proj", "o_proj", "q_norm", "k_norm", "mlp",
                                                                   "input_layernorm", "post_attention_layernorm"),
    ("models/qwen3_5.py", "Qwen3_5GatedDeltaNet"): ("in_proj_qkvz", "in_proj_ba", "conv1d", "A_log", "dt_bias", "norm",
                                                    "out_proj"),
    ("models/qwen3_5.py", "Qwen3_5LinearDecoderLayer"): ("linear_attn", "mlp", "input_layernorm",
                                                         "post_attention_layernorm"),
    ("models/qwen3_5.py", "Qwen3_5AttentionDecoderLayer"): ("qkv_proj", "o_proj", "q_norm", "k_norm", "mlp",
                                                            "input_layernorm", "post_attention_layernorm"),
    ("models/qwen2_moe.py", "Qwen2MoeSparseMoeBlock"): ("gate", "experts", "shared_expert", "shared_expert_gate"),
    ("models/qwen2_moe.py", "Qwen2MoeMLP"): ("gate_up_proj", "down_proj"),
}
DELTA_NET = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight",
             "out_proj.weight")
ATTENTION = ("qkv_proj.weight", "o_proj.weight", "q_norm.weight", "k_norm.weight")  # on the layer: `.self_attn` dropped
MOE = ("gate.weight", "experts.w13_weight", "experts.w2_weight", "shared_expert.gate_up_proj.weight",
       "shared_expert.down_proj.weight", "shared_expert_gate.weight")


def _sglang_params(config: dict[str, Any], prefix: str) -> list[str]:
    names = [f"{prefix}embed_tokens.weight", f"{prefix}norm.weight"]
    for i, kind in enumerate(config["layer_types"]):
        own = [f"linear_attn.{n}" for n in DELTA_NET] if kind == "linear_attention" else list(ATTENTION)
        names += [f"{prefix}layers.{i}.{n}" for n in (*own, *(f"mlp.{m}" for m in MOE), "input_layernorm.weight",
                                                      "post_attention_layernorm.weight")]
    return names


class _Param:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def weight_loader(self, param: "_Param", weight: Any, *args: Any, **kw: Any) -> None:
        shard = kw.get("shard_id", args[1] if len(args) > 1 else args[0] if args else None)
        self.calls.append((param.name, shard, kw.get("expert_id", args[2] if len(args) > 2 else None)))


def _tree(path: str) -> ast.Module:
    return ast.parse((SRT / path).read_text())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _method(path: str, cls: str, name: str, namespace: dict[str, Any]) -> Any:
    """`cls.name` from sglang's source, compiled in `namespace` (plus the file's module-level literals)."""
    tree = _tree(path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                namespace.setdefault(node.targets[0].id, ast.literal_eval(node.value))
            except ValueError:
                pass
    fn = next(n for n in _class(tree, cls).body if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.decorator_list = []
    exec(compile(ast.Module([fn], []), f"{SRT / path}:{cls}.{name}", "exec"), namespace)  # noqa: S102
    return namespace[name]


def _namespace(calls: list, warnings: list) -> dict[str, Any]:
    ns = {"torch": torch, "Iterable": Any, "Tuple": Any, "Set": Any, "Optional": Any, "_use_aiter": False,
          "logger": SimpleNamespace(warning=warnings.append, info=lambda *a: None),
          "default_weight_loader": lambda p, w: calls.append((p.name, None, None)),
          "QWEN3_5_KV_SCALE_MAPPER": SimpleNamespace(apply=lambda w: w)}  # renames KV-cache scales only
    mapping = _method("layers/moe/fused_moe_triton/layer.py", "FusedMoE", "make_expert_params_mapping",
                      {"List": Any, "Tuple": Any})  # a classmethod that does not read its class
    ns["FusedMoE"] = SimpleNamespace(make_expert_params_mapping=lambda **kw: mapping(None, **kw))
    get_layer_id = next(n for n in _tree("layers/utils/common.py").body
                        if isinstance(n, ast.FunctionDef) and n.name == "get_layer_id")
    exec(compile(ast.Module([get_layer_id], []), "get_layer_id", "exec"), ns)  # noqa: S102
    ns["re"] = __import__("re")
    return ns


def _loader(family: str, config: dict[str, Any], calls: list, warnings: list):
    """sglang's load_weights for `family`, bound to a stand-in model holding the parameters sglang's does."""
    ns = _namespace(calls, warnings)
    cfg = SimpleNamespace(num_experts=config["num_experts"], tie_word_embeddings=False)
    if family == "qwen3_next":
        params = {n: _Param(n, calls) for n in [*_sglang_params(config, "model."), "lm_head.weight"]}
        model = SimpleNamespace(config=cfg, enable_shared_expert_fusion=False, num_fused_shared_experts=0,
                                named_parameters=lambda **kw: params.items())
        return _method("models/qwen3_next.py", "Qwen3NextForCausalLM", "load_weights", ns).__get__(model), params
    body_params = {n: _Param(f"model.{n}", calls) for n in _sglang_params(config, "")}  # the body's own names
    body = SimpleNamespace(config=cfg, enable_shared_expert_fusion=False, num_fused_shared_experts=0, start_layer=0,
                           end_layer=len(config["layer_types"]), named_parameters=lambda **kw: body_params.items())
    body.load_weights = _method("models/qwen3_5.py", "Qwen3_5MoeForCausalLM", "load_weights", ns).__get__(body)
    head = {"lm_head.weight": _Param("lm_head.weight", calls)}
    outer = SimpleNamespace(config=cfg, pooler=None, model=body, pp_group=SimpleNamespace(is_last_rank=True),
                            named_parameters=lambda **kw: head.items())
    load = _method("models/qwen3_5_text.py", "Qwen3_5ForCausalLM", "load_weights", ns).__get__(outer)
    return load, {**{f"model.{n}": p for n, p in body_params.items()}, **head}


def _push(load, calls: list, warnings: list, name: str, tensor: torch.Tensor) -> list:
    """What sglang's loader does with one pushed tensor: the (param, shard, expert) loads, or why none."""
    del calls[:], warnings[:]
    try:
        load([(name, tensor)])
    except KeyError as e:
        return [f"no parameter {e}"]
    return list(calls) or [f"logged {warnings}" if warnings else "skipped"]


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def family(request, tmp_path_factory):
    from moe_rl.testing import make_tiny_qwen3_5_moe, make_tiny_qwen3_next

    build = {"qwen3_next": make_tiny_qwen3_next, "qwen3_5_moe": make_tiny_qwen3_5_moe}[request.param]
    path = build(tmp_path_factory.mktemp(request.param), seed=0)
    return request.param, HFCheckpoint(path), json.loads((path / "config.json").read_text())


def test_sglangs_modules_hold_the_parameters_listed_here():
    for (path, cls), attrs in MODULES.items():
        init = next(n for n in _class(_tree(path), cls).body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        assigned = {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
        assert set(attrs) <= assigned, (path, cls, set(attrs) - assigned)


def test_every_pushed_name_loads_in_sglang_and_every_parameter_and_shard_is_loaded(family):
    name, ckpt, config = family
    calls, warnings = [], []
    load, params = _loader(name, config, calls, warnings)
    loaded: dict[str, set] = {p: set() for p in params}
    for n in ckpt.weight_map:
        got = _push(load, calls, warnings, n, ckpt.get(n))
        assert all(isinstance(c, tuple) for c in got), (name, n, got)
        for param, shard, expert in got:
            loaded[param].add((shard, expert))
    experts = range(config["num_experts"])
    for p, shards in loaded.items():
        if p.endswith("experts.w13_weight"):
            assert shards == {(s, e) for s in ("w1", "w3") for e in experts}, (p, shards)
        elif p.endswith("experts.w2_weight"):
            assert shards == {("w2", e) for e in experts}, (p, shards)
        elif p.endswith("qkv_proj.weight"):
            assert shards == {("q", None), ("k", None), ("v", None)}, (p, shards)
        elif p.endswith("gate_up_proj.weight"):
            assert shards == {(0, None), (1, None)}, (p, shards)
        elif p.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight")) and name == "qwen3_5_moe":  # stored apart
            assert shards == ({((0, 1, 2), None), (3, None)} if "qkvz" in p else {(0, None), (1, None)}), (p, shards)
        else:
            assert shards == {(None, None)}, (p, shards)


def test_names_sglang_would_not_load_fail_here(family):
    # megatron's fused delta-net projection, a misnamed bias (sglang's loaders skip unknown *_bias names
    # silently) and a multi-token-prediction name (skipped): none reaches a parameter
    name, _, config = family
    calls, warnings = [], []
    load, _ = _loader(name, config, calls, warnings)
    t = torch.zeros(2, 2)
    for wrong in ("model.layers.0.linear_attn.in_proj.weight", "model.layers.0.linear_attn.dt_proj_bias",
                  "mtp.layers.0.mlp.gate.weight"):
        got = _push(load, calls, warnings, wrong, t)
        assert not any(isinstance(c, tuple) for c in got), (name, wrong, got)
    assert isinstance(_push(load, calls, warnings, "model.layers.0.linear_attn.dt_bias", t)[0], tuple)
