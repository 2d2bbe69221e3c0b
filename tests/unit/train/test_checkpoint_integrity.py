"""Checkpoint files carry sizes and checksums; resume names and skips (auto) or refuses (a path) damage."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.recipes import RLRecipe
from moe_rl.recipes.rl.rollouts import SyncRollouts
from moe_rl.train.checkpoint import intact_checkpoint, resume, save_checkpoint


class _State:
    """state_dict / load_state_dict of one tensor (what a policy, sampler or reward runner offers)."""

    def __init__(self, value: float) -> None:
        self.value = torch.full((4096,), value)  # 16 KiB: a zeroed 4 KiB page stays inside the file

    def state_dict(self):
        return {"value": self.value.clone()}

    def load_state_dict(self, state):
        self.value = state["value"]

    # a megatron model's distributed checkpoint, as files of a directory
    def save_sharded(self, ckpt_dir, async_save=False):
        ckpt_dir.mkdir()
        torch.save(self.state_dict(), ckpt_dir / "__0_0.distcp")
        (ckpt_dir / "metadata.json").write_text("{}")

    def load_sharded(self, ckpt_dir):
        self.load_state_dict(torch.load(ckpt_dir / "__0_0.distcp"))


def _run(value: float):
    return RLRecipe(SimpleNamespace(policy=_State(value), sampler=_State(value), rewards=_State(value), critic=None, rank=0,
                           weight_version=int(value), drift_state={}, engine=None,
                           cfg=load_config(None), weight_sync=SimpleNamespace(sync=lambda *a: None), rollouts=SyncRollouts()))


def _two_checkpoints(tmp_path):
    save_checkpoint(_run(1.0), tmp_path, 1, keep_last=3)
    return save_checkpoint(_run(2.0), tmp_path, 2, keep_last=3)


def _resumed(tmp_path, spec):
    run = _run(0.0)
    step = resume(run, load_config(None, [f"train.resume={spec}"]), tmp_path, logging.getLogger("test"))
    return step, float(run.run.policy.value[0])


def test_meta_records_every_file_and_an_intact_checkpoint_resumes(tmp_path):
    newest = _two_checkpoints(tmp_path)
    meta = json.loads((newest / "meta.json").read_text())
    assert set(meta["files"]) == {"rank_00000.pt", "policy/__0_0.distcp", "policy/metadata.json"}
    assert meta["files"]["rank_00000.pt"]["bytes"] == (newest / "rank_00000.pt").stat().st_size
    assert meta["format"] == "sharded"
    assert _resumed(tmp_path, "auto") == (2, 2.0)


def test_a_damaged_model_file_is_named_and_skipped(tmp_path, caplog):
    newest = _two_checkpoints(tmp_path)
    _zero_page(newest / "policy" / "__0_0.distcp")
    with caplog.at_level(logging.WARNING):
        assert _resumed(tmp_path, "auto") == (1, 1.0)
    assert f"{newest / 'policy' / '__0_0.distcp'} does not match the SHA-256" in caplog.text


def test_a_per_rank_checkpoint_of_another_world_size_is_refused_naming_what_resumes_it(tmp_path):
    newest = _two_checkpoints(tmp_path)
    meta = json.loads((newest / "meta.json").read_text())
    state = torch.load(newest / "rank_00000.pt", weights_only=False) | {"policy": _State(2.0).state_dict()}
    torch.save(state, newest / "rank_00000.pt")  # the earlier format: the model inside the rank file
    meta = {k: v for k, v in meta.items() if k not in ("format", "files")} | {"world_size": 1}
    (newest / "meta.json").write_text(json.dumps(meta))
    assert _resumed(tmp_path, "auto") == (2, 2.0)  # same world size: it loads
    (newest / "meta.json").write_text(json.dumps(meta | {"world_size": 2}))
    with pytest.raises(RuntimeError, match="per-rank format of earlier versions, written by 2 ranks; this run has 1: "
                                           "resume it once with train.world_size=2"):
        _resumed(tmp_path, str(newest))


def _truncate(f):
    f.write_bytes(f.read_bytes()[:1000])


def _zero_page(f):
    data = bytearray(f.read_bytes())
    data[6000:10096] = bytes(4096)
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,needle", [
    (_truncate, "bytes, {} were written"),
    (_zero_page, "does not match the SHA-256"),
    (lambda f: f.unlink(), "is missing"),
    (lambda f: (f.parent / "meta.json").write_text("{not json"), "not JSON"),
])
def test_damaged_newest_is_named_and_skipped_for_the_newest_intact(tmp_path, caplog, damage, needle):
    newest = _two_checkpoints(tmp_path)
    size = (newest / "rank_00000.pt").stat().st_size
    damage(newest / "rank_00000.pt")
    with caplog.at_level(logging.WARNING):
        assert intact_checkpoint(tmp_path, 0, logging.getLogger("test")) == tmp_path / "checkpoints" / "step_000001"
    assert f"skipping damaged checkpoint {newest}" in caplog.text and needle.format(size) in caplog.text
    assert _resumed(tmp_path, "auto") == (1, 1.0)  # the older, intact checkpoint


def test_a_damaged_checkpoint_given_by_path_is_refused_naming_the_file(tmp_path):
    newest = _two_checkpoints(tmp_path)
    _zero_page(newest / "rank_00000.pt")
    with pytest.raises(RuntimeError, match=f"cannot resume from {newest}: {newest / 'rank_00000.pt'} does not match"):
        _resumed(tmp_path, str(newest))
