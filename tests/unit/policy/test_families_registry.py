"""The family registry (moe_rl/policy/families/): each family reads its own configs as itself, by
architecture and by model type, its fresh `model.tiny` shape reads back as itself, and no product
module outside its file spells its HF architecture (a family is defined in one place)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from moe_rl.policy.families.registry import BY_NAME, FAMILIES, TINY_FAMILIES, arch_from_hf_dict, family_of
from moe_rl.policy.model import UnsupportedModel
from moe_rl.policy.tiny import TinyMoEConfig

PACKAGE = Path(__file__).resolve().parents[3] / "moe_rl"


def _example(family):
    """The family's tiny test config as config.json holds it (Qwen3-MoE's is the demo's shape)."""
    cfg = family.hf_config(**family.example) if family.example else family.tiny(TinyMoEConfig())
    return cfg.to_dict()


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_a_family_reads_its_config_as_itself_by_architecture_and_by_model_type(name):
    family = BY_NAME[name]
    raw = _example(family)
    assert raw["architectures"] == [family.architecture]
    arch = arch_from_hf_dict(raw)
    assert (arch.family, arch.hf_architecture) == (family.name, family.architecture)
    assert family_of(raw) is family
    assert (arch.linear_attention is not None) == family.linear_attention
    for model_type in family.model_types:  # a config.json without `architectures`
        bare = {k: v for k, v in raw.items() if k != "architectures"} | {"model_type": model_type}
        assert arch_from_hf_dict(bare).family == family.name


@pytest.mark.parametrize("name", TINY_FAMILIES)
def test_a_fresh_tiny_model_of_each_family_is_read_as_that_family(name):
    shape = TinyMoEConfig(num_hidden_layers=2)
    arch = arch_from_hf_dict(BY_NAME[name].tiny(shape).to_dict())
    assert arch.family == name and arch.num_layers == 2 and arch.num_moe_experts == shape.num_experts


def test_an_unknown_or_refused_architecture_names_the_supported_ones():
    with pytest.raises(UnsupportedModel, match="supported: .*MixtralForCausalLM.*Qwen3MoeForCausalLM"):
        arch_from_hf_dict({"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(UnsupportedModel, match="vision-language"):
        arch_from_hf_dict({"model_type": "qwen3_5_moe"})


def test_no_product_module_outside_its_file_spells_a_familys_architecture():
    names = {f.architecture: f.name for f in FAMILIES}
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names and rel != f"policy/families/{names[node.value]}.py":
                found.append(f"{rel}:{node.lineno} {node.value}")
    assert not found, f"a family's architecture spelled outside its file: {found}"


def test_a_family_without_an_example_shape_is_refused_rather_than_built_at_hf_defaults(tmp_path):
    from moe_rl.policy.families.registry import make_example

    with pytest.raises(ValueError, match="qwen3_moe has no example shape of its own"):
        make_example("qwen3_moe", tmp_path / "m")
    assert not (tmp_path / "m").exists()
