"""What `moe-rl serve` checks and writes when it takes pushed tensors (`moe_rl/rollout/weight_load.py`):
a NaN anywhere in a received bucket is refused by name, and the per-model cache of where each name
writes follows a disk update onto the new model."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from moe_rl.rollout.local_engine import LocalEngine
from moe_rl.rollout.flat import joined
from moe_rl.rollout.weight_load import apply_sparse
from moe_rl.rollout.weight_sync import TensorMeta, flatten_bucket, unflatten_bucket

EMBED, NORM = "model.embed_tokens.weight", "model.norm.weight"
EXPERT = "model.layers.1.mlp.experts.2.down_proj.weight"


@pytest.fixture()
def engine(tiny_hf_dir):
    eng = LocalEngine(tiny_hf_dir, seed=0)
    yield eng
    eng.close()


def _checkpoint(tiny_hf_dir) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(tiny_hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def _received(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The tensors as a receiver holds them: views into one flat bucket."""
    return unflatten_bucket(flatten_bucket(list(tensors.values())), [TensorMeta.of(n, t) for n, t in tensors.items()])


def test_a_received_buckets_tensors_are_checked_without_a_copy_and_others_by_one():
    tensors = {f"w{i}": torch.randn(3, i + 1) for i in range(4)}
    got = [t for _, t in _received(tensors)]
    whole = joined(got)
    assert whole.data_ptr() == got[0].data_ptr() and whole.numel() == sum(t.numel() for t in got)  # a view
    assert torch.equal(whole, torch.cat([t.reshape(-1) for t in tensors.values()]))
    shuffled = [got[2], got[0], got[3]]  # not back to back: copied, in the order given
    copy = joined(shuffled)
    assert copy.data_ptr() != got[0].data_ptr()
    assert torch.equal(copy, torch.cat([t.reshape(-1) for t in shuffled]))
    strided = [got[0], got[1].t()]  # not contiguous: copied
    assert torch.equal(joined(strided), torch.cat([t.reshape(-1) for t in strided]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_inside_a_received_bucket_is_refused_by_name_and_nothing_is_written(engine, tiny_hf_dir, bad):
    ckpt = _checkpoint(tiny_hf_dir)
    pushed = {n: ckpt[n] * 0 + 7 for n in (EMBED, EXPERT, NORM)}
    items = _received(pushed)
    items[1][1].view(-1)[3] = bad  # the middle tensor of the bucket
    before = {n: p.clone() for n, p in engine.model.named_parameters()}
    with pytest.raises(ValueError, match=rf"{EXPERT}: holds NaN or inf") as err:
        engine.update_weights_from_tensors(items)
    assert EMBED not in str(err.value) and NORM not in str(err.value)
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, before[n]), n
    items[1][1].view(-1)[3] = 7.0  # mended, the same bucket loads
    engine.update_weights_from_tensors(items)
    assert torch.equal(engine.model.get_parameter(EMBED), pushed[EMBED])
    assert torch.equal(engine.model.get_parameter(NORM), pushed[NORM])


def test_a_push_after_a_disk_update_writes_into_the_new_model(engine, tiny_hf_dir):
    ckpt = _checkpoint(tiny_hf_dir)
    engine.update_weights_from_tensors([(EMBED, ckpt[EMBED] + 1), (EXPERT, ckpt[EXPERT] + 1)])  # names resolved
    old = engine.model
    engine.update_weights_from_disk(tiny_hf_dir)
    assert engine.model is not old
    engine.update_weights_from_tensors([(EMBED, ckpt[EMBED] + 2), (EXPERT, ckpt[EXPERT] + 2)])
    assert torch.equal(engine.model.get_parameter(EMBED), ckpt[EMBED] + 2)
    # the expert lives in the fused tensor transformers keeps: compare through the engine's own export
    fused = dict(engine.model.named_parameters())["model.layers.1.mlp.experts.down_proj"]
    assert torch.equal(fused[2], ckpt[EXPERT] + 2)
    assert torch.equal(old.get_parameter(EMBED), ckpt[EMBED] + 1)  # the swapped-out model was left alone


def test_element_deltas_into_every_served_tensor_equal_the_whole_tensors_pushed(tiny_hf_dir):
    """Sparse deltas write through every kind of served view (whole tensors, one expert of a fused
    tensor, a half of a fused gate/up pair) exactly where the same values pushed whole go."""
    ckpt = _checkpoint(tiny_hf_dir)
    g = torch.Generator().manual_seed(3)
    new, deltas = {}, []
    for name, t in ckpt.items():
        if not t.is_floating_point():
            continue
        changed = torch.rand(t.numel(), generator=g) < 0.05
        idx = changed.nonzero().reshape(-1)
        values = (t.reshape(-1)[idx].float() + 1).to(t.dtype)
        full = t.clone().reshape(-1)
        full[idx] = values
        new[name] = full.reshape(t.shape)
        deltas.append((name, values, idx))
    sparse, dense = LocalEngine(tiny_hf_dir, seed=0), LocalEngine(tiny_hf_dir, seed=0)
    try:
        sparse.update_weights_sparse(deltas)
        dense.update_weights_from_tensors(list(new.items()))
        got, want = dict(sparse.model.named_parameters()), dict(dense.model.named_parameters())
        for n in want:
            assert torch.equal(got[n], want[n]), n
    finally:
        sparse.close()
        dense.close()


@pytest.mark.parametrize("view", [lambda t: t[1, :, 5:], lambda t: t[2].t(), lambda t: t[:, 3]])
def test_element_deltas_write_through_strided_views(view):
    """A served name may be a strided view (a half along the last dim of a fused pair, a transpose):
    the flat row-major indices land where writing the view's flattened copy would put them."""
    base = torch.arange(4 * 6 * 10, dtype=torch.float32).reshape(4, 6, 10).to(torch.bfloat16)
    want = base.clone()
    target = view(want)
    assert not target.is_contiguous()
    idx = torch.randperm(target.numel(), generator=torch.Generator().manual_seed(0))[:7]
    values = -torch.arange(1, 8, dtype=torch.bfloat16)
    flat = target.reshape(-1).clone()
    flat[idx] = values
    target.copy_(flat.view(target.shape))
    apply_sparse([(view(base), idx, values)])
    assert torch.equal(base, want)
