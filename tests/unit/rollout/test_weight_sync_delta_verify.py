"""The pieces of delta pushes and verification, on one process: what a delta carries, its wire format
and its decoding, the fused-pair rule in a rank's buckets, and the checksum comparison."""
from __future__ import annotations

import hashlib

import pytest
import torch

from moe_rl.rollout.weight_sync import (DeltaBase, TensorMeta, flatten_sparse, local_buckets, mismatches,
                                        tensor_checksum, unflatten_sparse)
from moe_rl.rollout.weight_sync.delta import encode, sparse_bucket_nbytes


def test_encode_skips_unchanged_sends_changed_elements_or_the_whole_tensor():
    g = torch.Generator().manual_seed(0)
    prev = torch.randn(64, 8, generator=g).to(torch.bfloat16)
    assert encode(prev, prev.clone(), sparse=True) is None                      # nothing changed: nothing sent
    new = prev.clone()
    new[3, 5] += 1.0
    new[60, 0] -= 1.0
    payload, nnz = encode(prev, new, sparse=True)
    assert nnz == 2 and payload.dtype == torch.uint8 and payload.numel() == 2 * (4 + 2)
    whole, k = encode(prev, new, sparse=False)                                   # SGLang: the tensor, whole
    assert k == -1 and torch.equal(whole, new)
    many = prev + 1.0                                                            # most changed: whole is smaller
    assert encode(prev, many, sparse=True)[1] == -1
    # bits, not values: -0.0 differs from 0.0, and a NaN that stays NaN is unchanged
    z = torch.zeros(4)
    assert encode(z, -z, sparse=True) is not None
    nan = torch.full((4,), float("nan"))
    assert encode(nan, nan.clone(), sparse=True) is None


def test_sparse_wire_format_round_trips_and_applies_like_the_dense_update():
    g = torch.Generator().manual_seed(1)
    olds = [torch.randn(5, 7, generator=g), torch.randn(3, generator=g).to(torch.bfloat16), torch.randn(2, 2, generator=g)]
    news = [o.clone() for o in olds]
    news[0][1, 2] = 9.0
    news[0][4, 6] = -9.0
    news[1][0] = 5.0
    news[2] += 3.0                                                                # all changed: goes whole
    metas, payloads, nnz = [], [], []
    for i, (o, n) in enumerate(zip(olds, news)):
        payload, k = encode(o, n, sparse=True)
        metas.append(TensorMeta.of(f"t{i}", n))
        payloads.append(payload.reshape(-1).view(torch.uint8) if k >= 0 else n)
        nnz.append(k)
    flat = flatten_sparse(payloads)
    assert flat.numel() == sparse_bucket_nbytes(metas, nnz) and flat.numel() % 8 == 0
    for (name, values, idx), o, n in zip(unflatten_sparse(flat, metas, nnz), olds, news):
        rebuilt = values if idx is None else o.clone().reshape(-1).index_put_((idx,), values).reshape(o.shape)
        assert torch.equal(rebuilt, n), name
    with pytest.raises(ValueError, match="outside"):
        bad = flat.clone()
        bad[:4] = torch.tensor([1000], dtype=torch.int32).view(torch.uint8)    # t0's first index: out of range
        unflatten_sparse(bad, metas, nnz)


def test_the_base_is_recorded_as_pushed_and_only_a_valid_base_makes_deltas():
    base = DeltaBase()
    t = torch.arange(6.0)
    assert base.encode("w", t, sparse=True)[1] == -1                             # no base yet: whole
    base.valid = True
    t2 = t.clone()
    t2[2] = 100.0
    payload, nnz = base.encode("w", t2, sparse=True)
    assert nnz == 1 and base.last_changed == 1 and torch.equal(base.values["w"], t2)
    assert base.encode("w", t2.clone(), sparse=True) is None and base.last_changed == 0
    base.valid = False                                                            # a failed push: full again
    assert base.encode("w", t2, sparse=True)[1] == -1


def test_a_fused_pair_shares_a_bucket_whatever_comes_between():
    a = "model.layers.0.self_attn.q_a_proj.weight"
    b = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    pairs = [(a, torch.zeros(64)), ("model.layers.0.mlp.gate.weight", torch.zeros(64)), (b, torch.zeros(64)),
             ("model.norm.weight", torch.zeros(64))]
    buckets = list(local_buckets(pairs, bucket_bytes=256))                        # one fp32 tensor = 256 bytes
    where = {m.name: i for i, bucket in enumerate(buckets) for m, _ in bucket}
    assert where[a] == where[b] and sorted(where) == sorted(n for n, _ in pairs)
    assert all(sum(m.nbytes for m, _ in bucket) <= 512 for bucket in buckets)


def test_checksums_are_sglangs_host_hash_and_mismatches_name_tensor_and_server():
    t = torch.arange(10, dtype=torch.bfloat16)
    want = int.from_bytes(hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).digest()[:8], "big")
    assert tensor_checksum(t) == f"{want:016x}"
    sent = {"a": tensor_checksum(t), "b": tensor_checksum(t + 1)}
    good = {"ranks": [{"checksums": dict(sent)}], "per_engine_checksum": "x"}
    assert mismatches(sent, [("http://s0", good)], 3, [1]) == []
    bad = {"ranks": [{"checksums": {"a": sent["a"], "b": "0" * 16}}]}
    (problem,) = mismatches(sent, [("http://s1", bad)], 3, [1])
    assert "server http://s1 holds b" in problem and "weight version 3" in problem
    # SGLang's runtime names match none of ours: the servers of one tp size must agree
    runtime = [("http://s0", {"ranks": [{"checksums": {"qkv_proj": "1"}}], "per_engine_checksum": "p"}),
               ("http://s1", {"ranks": [{"checksums": {"qkv_proj": "2"}}], "per_engine_checksum": "q"})]
    (problem,) = mismatches(sent, runtime, 4, [2, 2])
    assert "tp-2 servers disagree" in problem
    assert mismatches(sent, [runtime[0], ("http://s1", runtime[0][1])], 4, [2, 2]) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_a_pushed_nan_or_inf_is_found_in_any_float_dtype_and_named(dtype):
    from moe_rl.rollout.weight_load import _not_finite

    fine = torch.tensor([torch.finfo(dtype).max, torch.finfo(dtype).min, torch.finfo(dtype).tiny, 0.0, -0.0, 1.5],
                        dtype=dtype)
    items = [(f"w{i}", fine.clone()) for i in range(4)] + [("ids", torch.arange(3))]
    assert _not_finite(items) == set()
    # finite values whose sum overflows: the fast check's inf sends them to the exact test, which passes them
    assert _not_finite([("big", torch.full((8,), torch.finfo(dtype).max, dtype=dtype))]) == set()
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = [(n, t.clone()) for n, t in items]
        broken[2][1][4] = bad
        assert _not_finite(broken) == {"w2"}, bad


def test_after_many_element_deltas_the_base_holds_the_last_pushed_bits():
    """The base takes an element delta's elements only (NaN payloads and -0.0 included, compared as
    bits), a whole tensor's all of them: after every push it equals what was pushed, bit for bit."""
    g = torch.Generator().manual_seed(0)
    base, t = DeltaBase(), torch.randn(40, 30, generator=g).to(torch.bfloat16)
    base.encode("w", t.clone(), sparse=True)
    base.valid = True
    for step in range(6):
        t = t.clone()
        n = 3 if step % 2 else 1000  # a few elements (sparse), then most of them (whole)
        where = torch.randperm(t.numel(), generator=g)[:n]
        t.view(-1)[where] = torch.randn(n, generator=g).to(torch.bfloat16)
        t.view(-1)[where[:1]] = float("nan") if step == 1 else -0.0
        payload, nnz = base.encode("w", t, sparse=True)
        assert (nnz >= 0) == (n == 3), (step, nnz)
        assert torch.equal(base.values["w"].view(torch.int16), t.view(torch.int16)), step


def test_encoding_many_tensors_at_once_equals_encoding_each_against_its_base():
    """`DeltaBase.encode_many` (one pass over a bucket's worth) gives each tensor exactly what
    `encode(prev, new)` of that tensor alone gives: skipped, whole, or its changed elements; over
    mixed widths, a tensor new to the base, one whose shape changed, and a second push compared
    against the flat base the first one left."""
    from moe_rl.rollout.weight_sync.delta import encode

    g = torch.Generator().manual_seed(1)
    shapes = {"a": (5, 7), "b": (64,), "c": (3, 4, 5), "d": (9,), "e": (2, 50)}
    dtypes = {"a": torch.bfloat16, "b": torch.float32, "c": torch.bfloat16, "d": torch.float32, "e": torch.bfloat16}
    base = DeltaBase()
    old = {n: torch.randn(s, generator=g).to(dtypes[n]) for n, s in shapes.items()}
    base.encode_many([(n, t, True) for n, t in old.items()])
    base.valid = True
    for push in range(2):
        new = {n: t.clone() for n, t in old.items()}
        new["a"].view(-1)[[0, 9]] += 1          # a few elements: sparse
        new["b"] += 1                           # all of them: whole
        # "c" unchanged: skipped
        new["d"] = torch.randn(10, generator=g)  # its shape changed: whole
        new["e"].view(-1)[3] = float("nan")     # one element, NaN bits
        new["f"] = torch.randn(4, generator=g).to(torch.bfloat16)  # new to the base: whole
        items = [(n, t, n != "b" or push == 0) for n, t in new.items()]
        got = base.encode_many(items)
        for (n, t, sparse), (out, changed) in zip(items, got):
            want = encode(old.get(n), t, sparse)
            assert (out is None) == (want is None), (push, n)
            if out is not None:
                assert out[1] == want[1] and torch.equal(out[0].view(torch.uint8), want[0].view(torch.uint8)), (push, n)
            prev = old.get(n)
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
            differ = (t.numel() if prev is None or prev.shape != t.shape or prev.dtype != t.dtype
                      else int((prev.reshape(-1).view(bits) != t.reshape(-1).view(bits)).sum()))
            assert changed == differ, (push, n)
        for n, t in new.items():
            assert torch.equal(base.values[n].view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), (push, n)
        old = new
