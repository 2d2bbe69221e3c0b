"""`moe-rl config` and docs/reference/config.md: the config reference is generated from the RunConfig tree."""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from moe_rl import cli
from moe_rl.algo.losses import LOSSES
from moe_rl.config import LOG_LEVELS, RunConfig
from moe_rl.config_reference import REGENERATE, lookup, reference, render_markdown, show_default

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reference" / "config.md"


def leaf_defaults(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, typing.Any]]:
    """(dotted key, default) of every leaf field, walked independently of moe_rl.config_reference:
    defaults are read from a default-constructed RunConfig."""
    out = []
    obj = cls()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += leaf_defaults(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", getattr(obj, f.name)))
    return out


def config(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = cli.main(["config", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_docs_config_md_is_what_the_generator_writes():
    assert DOCS.is_file(), f"docs/reference/config.md is missing; write it with `{REGENERATE}`"
    assert DOCS.read_text() == render_markdown(), \
        f"docs/reference/config.md is out of date with the config dataclasses; regenerate it with `{REGENERATE}`"


def test_every_leaf_key_appears_exactly_once_with_its_dataclass_default():
    keys = [k.key for k in reference()]
    assert len(keys) == len(set(keys))
    expected = leaf_defaults()
    assert sorted(keys) == sorted(k for k, _ in expected)  # a section's keys come before its nested sections
    defaults = {k.key: k.default for k in reference()}
    for key, default in expected:
        assert defaults[key] == default and type(defaults[key]) is type(default), key


def test_every_key_has_a_doc_and_a_type():
    for k in reference():
        assert k.doc and k.summary and k.type, k.key


def test_markdown_has_every_key_once():
    md = render_markdown()
    for key, _ in leaf_defaults():
        assert md.count(f"| `{key}` |") == 1, key
    assert "## `model.tiny`" in md and "## `algo.rollout_correction`" in md


def test_allowed_values_are_the_choices_and_ranges():
    assert lookup("log.level").allowed == ", ".join(LOG_LEVELS)
    assert lookup("algo.loss").allowed == ", ".join(LOSSES)  # a registry's names
    assert lookup("train.steps").allowed == ">= 1"
    assert lookup("log.wandb").allowed == ""
    assert lookup("log.report").summary.startswith("Write the report")


def test_no_argument_lists_every_section_and_key(capsys):
    rc, out, _ = config([], capsys)
    assert rc == 0
    for key, default in leaf_defaults():
        assert f"  {key} = {show_default(default)}  (" in out, key


def test_a_section_prints_its_keys_and_nested_sections_only(capsys):
    rc, out, _ = config(["algo"], capsys)
    assert rc == 0
    assert "algo.max_staleness = 0  (int; >= 0)" in out
    assert "algo.rollout_correction.mode" in out  # nested section included
    assert "log.name" not in out and "critic." not in out


def test_a_key_prints_its_whole_doc(capsys):
    rc, out, _ = config(["algo.max_staleness"], capsys)
    assert rc == 0
    assert "type:    int" in out and "default: 0" in out and "allowed: >= 0" in out
    doc = " ".join(lookup("algo.max_staleness").doc.split())
    assert " ".join(out.split()).endswith(doc)
    assert "rollout.inflight_update=in_place" in out  # the doc's last sentence, not only its first


@pytest.mark.parametrize("name, nearest", [
    ("algo.max_stalenes", "algo.max_staleness"),
    ("algoo", "algo"),
    ("model.tiny.hiden_size", "model.tiny.hidden_size"),
    ("max_staleness", "algo.max_staleness"),
])
def test_an_unknown_name_exits_2_naming_it_and_the_nearest(capsys, name, nearest):
    rc, out, err = config([name], capsys)
    assert rc == 2 and out == ""
    assert name in err and f"'{nearest}'" in err


def test_a_name_below_a_key_exits_2(capsys):
    rc, _, err = config(["algo.loss.x"], capsys)
    assert rc == 2 and "algo.loss is a key" in err


def test_markdown_flag_prints_the_reference(capsys):
    rc, out, _ = config(["--markdown"], capsys)
    assert rc == 0 and out == render_markdown()


def test_train_help_points_at_the_reference(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "moe-rl config" in out and "docs/reference/config.md" in out
