"""Weight sync pieces on one CPU process: buckets, SGLang payloads, DiskSync versioning, TensorSync,
and NcclSync's protocol against a fake SGLang server over gloo."""
from __future__ import annotations

import json
import multiprocessing as mp
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_rl.config import RolloutConfig
from moe_rl.rollout.sglang_api import bucket_payloads, init_group_payload, update_payload
from moe_rl.rollout.weight_sync import (DiskSync, NcclSync, TensorMeta, TensorSync, WeightSyncError, dtype_name,
                                        flatten_bucket, group_rank_offsets, list_versions, make_weight_sync,
                                        plan_buckets, unflatten_bucket, version_dir)
from moe_rl.testing import free_port


def M(name, shape, dtype="float32", owner=0):
    return TensorMeta(name, tuple(shape), dtype, owner)


# ----------------------------------------------------------------------------- buckets

def test_buckets_keep_order_and_size_and_isolate_big_tensors():
    metas = [M("a", [10]), M("b", [10]), M("c", [100]), M("d", [5]), M("e", [5]), M("f", [30])]  # 40,40,400,20,20,120 B
    buckets = plan_buckets(metas, bucket_bytes=100)
    assert [[m.name for m in b] for b in buckets] == [["a", "b"], ["c"], ["d", "e"], ["f"]]
    assert [m for b in buckets for m in b] == metas  # nothing lost, order kept
    assert all(sum(m.nbytes for m in b) <= 100 for b in buckets if len(b) > 1)
    assert plan_buckets(metas, 100) == buckets  # deterministic
    assert plan_buckets([], 100) == []
    assert [[m.name for m in b] for b in plan_buckets(metas, 1)] == [[m.name] for m in metas]
    with pytest.raises(ValueError):
        plan_buckets(metas, 0)


def test_buckets_respect_sglang_alignment():
    # 3 bf16 values = 6 bytes: a float32 after it would sit at offset 6, which SGLang refuses
    metas = [M("h", [3], "bfloat16"), M("f", [2], "float32"), M("g", [1], "bfloat16"), M("i", [1], "int64")]
    buckets = plan_buckets(metas, bucket_bytes=1 << 20)
    assert [[m.name for m in b] for b in buckets] == [["h"], ["f", "g"], ["i"]]
    for b in buckets:
        off = 0
        for m in b:
            assert off % m.itemsize == 0
            off += m.nbytes


def test_a_pair_sglang_fuses_stays_together_in_one_bucket():
    # SGLang's DeepSeek loader fuses a layer's q_a_proj and kv_a_proj_with_mqa only when both come in
    # the same load; a bucket boundary between them would leave that layer's old weights serving
    from moe_rl.rollout.fused_weights import pair_fused, split_pairs

    a = "model.layers.3.self_attn."
    names = [f"{a}q_a_proj.weight", f"{a}q_a_layernorm.weight", f"{a}q_b_proj.weight",
             f"{a}kv_a_proj_with_mqa.weight", f"{a}kv_b_proj.weight", "model.norm.weight"]
    ordered = [n for n, _ in pair_fused([(n, i) for i, n in enumerate(names)])]
    assert ordered == [names[0], names[3], names[1], names[2], names[4], names[5]]  # the partner moved up only
    metas = [M(names[5], [15]), M(ordered[0], [10]), M(ordered[1], [10]), M(ordered[2], [5])]  # 60, 40, 40, 20 B
    buckets = [[m.name for m in b] for b in plan_buckets(metas, bucket_bytes=100)]
    assert buckets == [[names[5]], [ordered[0], ordered[1], ordered[2]]]  # the pair did not fit beside 60 B
    assert split_pairs([names[0]], names) == [names[0]]  # a lone one
    assert split_pairs(names[:1] + names[3:4], names) == []
    assert split_pairs([f"{a}kv_a_proj_with_mqa.weight"], [f"{a}kv_a_proj_with_mqa.weight"]) == []  # no q_a_proj:
    # (q_lora_rank None) SGLang loads kv_a_proj_with_mqa alone


def _sglang_receive(payload, flat):
    """What SGLang does with a flattened bucket (FlattenedTensorBucket.empty + reconstruct_tensors)."""
    out, offset = [], 0
    for name, dtype, shape in zip(payload["names"], payload["dtypes"], payload["shapes"], strict=True):
        dtype = getattr(torch, dtype)
        assert offset % dtype.itemsize == 0, f"unaligned {name}"
        size = torch.Size(shape).numel() * dtype.itemsize
        out.append((name, flat[offset:offset + size].view(dtype).reshape(shape)))
        offset += size
    assert offset == flat.numel()
    return out


def test_flattened_buckets_round_trip_through_sglangs_receiver():
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(7, 3, generator=g).to(torch.bfloat16),
               "model.norm.weight": torch.randn(5, generator=g),
               "model.layers.0.mlp.experts.3.down_proj.weight": torch.randn(2, 3, generator=g).half(),
               "scalar": torch.tensor(1.5), "empty": torch.zeros(0, 4)}
    metas = [TensorMeta.of(n, t) for n, t in tensors.items()]
    assert metas[0].dtype == "bfloat16" and metas[0].shape == (7, 3)
    for bucket, payload in zip(plan := plan_buckets(metas, 64), bucket_payloads(plan, "grp", 3)):
        flat = flatten_bucket([tensors[m.name] for m in bucket])
        assert flat.dtype == torch.uint8 and flat.numel() == sum(m.nbytes for m in bucket)
        for (name, got), (name2, mine) in zip(_sglang_receive(payload, flat), unflatten_bucket(flat, bucket)):
            assert name == name2 and torch.equal(got, tensors[name]) and torch.equal(mine, tensors[name])


def test_dtype_names_are_torch_attributes():
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
        assert getattr(torch, dtype_name(dt)) is dt
    assert dtype_name(torch.bfloat16) == "bfloat16"


# ----------------------------------------------------------------------------- payloads

def test_update_payload_matches_sglang_request_fields():
    b = [M("x", [2, 3], "bfloat16"), M("y", [4])]
    p = update_payload(b, "wg", flush_cache=True, weight_version="7")
    # sglang/srt/managers/io_struct.py UpdateWeightsFromDistributedReqInput
    assert p == {"names": ["x", "y"], "dtypes": ["bfloat16", "float32"], "shapes": [[2, 3], [4]],
                 "group_name": "wg", "flush_cache": True, "abort_all_requests": False, "weight_version": "7",
                 "load_format": "flattened_bucket"}
    assert "load_format" not in update_payload(b, "wg", flush_cache=False, weight_version=None, load_format=None)
    json.dumps(p)  # plain JSON


def test_only_the_last_bucket_flushes_and_sets_the_version():
    buckets = [[M("a", [1])], [M("b", [1])], [M("c", [1])]]
    ps = bucket_payloads(buckets, "wg", 12)
    assert [p["flush_cache"] for p in ps] == [False, False, True]
    assert [p["weight_version"] for p in ps] == [None, None, "12"]
    assert not any(p["flush_cache"] for p in bucket_payloads(buckets, "wg", 1, flush_cache=False))


def test_init_group_payload_and_rank_offsets():
    offsets, world = group_rank_offsets([2, 4, 1])
    assert offsets == [1, 3, 7] and world == 8  # trainer is rank 0; server i's TP rank r is offset + r
    assert init_group_payload("10.0.0.1", 29600, 3, 8, "wg") == {
        "master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 3, "world_size": 8,
        "group_name": "wg", "backend": "nccl"}
    with pytest.raises(ValueError):
        group_rank_offsets([1, 0])


def test_factory_picks_by_config(tmp_path):
    assert isinstance(make_weight_sync(RolloutConfig(weight_sync="disk"), root=tmp_path), DiskSync)
    assert isinstance(make_weight_sync(RolloutConfig(engine="inprocess", weight_sync="tensor")), TensorSync)
    nccl = make_weight_sync(RolloutConfig(engine="sglang", weight_sync="nccl"),
                            admin_urls=["http://a:1", "http://b:2"], master_address="127.0.0.1",
                            master_port=1234, server_tp_sizes=[2, 2])
    assert isinstance(nccl, NcclSync) and nccl.tp_sizes == [2, 2]  # one group per (source, server): 1 + 2 ranks each
    assert nccl.verify and not nccl.delta  # the defaults: verified, full pushes
    with pytest.raises(ValueError, match="root"):
        make_weight_sync(RolloutConfig(weight_sync="disk"))
    with pytest.raises(ValueError, match="admin_urls"):
        make_weight_sync(RolloutConfig(engine="sglang", weight_sync="nccl"))
    with pytest.raises(ValueError, match="tensor cannot reach SGLang servers .*use disk or nccl"):
        make_weight_sync(RolloutConfig(engine="sglang", weight_sync="tensor"))
    with pytest.raises(ValueError, match="tensor cannot reach `moe-rl serve` servers"):
        make_weight_sync(RolloutConfig(engine="local", weight_sync="tensor"))
    with pytest.raises(ValueError, match="nccl cannot reach the local engine inside trainer rank 0"):
        make_weight_sync(RolloutConfig(engine="inprocess", weight_sync="nccl"))
    # moe-rl serve (engine local) joins the same update group over gloo
    gloo = make_weight_sync(RolloutConfig(engine="local", weight_sync="nccl"), admin_urls=["http://a:1"],
                            master_address="h", master_port=1, backend="gloo")
    assert isinstance(gloo, NcclSync) and gloo.backend == "gloo" and gloo.tp_sizes == [1]


# ----------------------------------------------------------------------------- DiskSync

class FakeEngine:
    """Loads `w` from a checkpoint dir; `fail` makes the next load raise."""

    def __init__(self):
        self.loaded, self.fail, self.value = [], None, None

    def update_weights(self, path, version=None):
        if self.fail:
            raise ValueError(self.fail)
        self.value = float(load_file(Path(path) / "model.safetensors")["w"])
        self.loaded.append((path, version))


def exporter(value, root=None, fail_after_first_file=False):
    def export(out_dir: Path):
        if root is not None:  # atomicity: while exporting, no committed dir of this version exists
            assert not version_dir(root, int(value)).exists()
            assert int(value) not in [v for v, _ in list_versions(root)]
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file({"w": torch.tensor(float(value))}, str(out_dir / "model.safetensors"))
        if fail_after_first_file:
            raise OSError("disk full")
        (out_dir / "config.json").write_text("{}")
    return export


def test_disk_sync_versions_and_cleanup(tmp_path):
    engine, sync = FakeEngine(), DiskSync(tmp_path, keep_last=2)
    for v in (1, 2, 3):
        path = sync.sync(v, exporter(v, tmp_path), engine)
        assert path == tmp_path / f"v{v:06d}" and engine.value == v
    assert [p.name for _, p in list_versions(tmp_path)] == ["v000002", "v000003"]
    assert engine.loaded[-1] == (str(tmp_path / "v000003"), "3")
    assert sync.served == tmp_path / "v000003"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000002", "v000003"]  # no .tmp, no trash


def test_failed_export_leaves_no_version_dir(tmp_path):
    engine, sync = FakeEngine(), DiskSync(tmp_path, keep_last=2)
    sync.sync(1, exporter(1), engine)
    with pytest.raises(WeightSyncError, match=r"export of weight version 2 into .*v000002\.tmp failed.*disk full"):
        sync.sync(2, exporter(2, fail_after_first_file=True), engine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001"]
    assert engine.value == 1 and len(engine.loaded) == 1 and sync.served == tmp_path / "v000001"
    with pytest.raises(WeightSyncError, match="config.json is missing"):
        sync.sync(2, lambda d: (d.mkdir(), save_file({"w": torch.ones(())}, str(d / "model.safetensors"))), engine)
    with pytest.raises(WeightSyncError, match="no directory"):
        sync.sync(2, lambda d: None, engine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001"]
    sync.sync(2, exporter(2), engine)  # the version can be retried
    assert engine.value == 2


def test_refused_update_keeps_the_served_dir(tmp_path):
    engine, sync = FakeEngine(), DiskSync(tmp_path, keep_last=1)
    sync.sync(1, exporter(1), engine)
    engine.fail = "incomplete checkpoint"
    with pytest.raises(WeightSyncError) as err:
        sync.sync(2, exporter(2), engine)
    msg = str(err.value)
    assert "FakeEngine" in msg and str(tmp_path / "v000002") in msg and "incomplete checkpoint" in msg
    assert f"keeps serving {tmp_path / 'v000001'}" in msg
    assert (tmp_path / "v000001" / "model.safetensors").is_file() and sync.served == tmp_path / "v000001"
    engine.fail = None
    sync.sync(3, exporter(3), engine)  # keep_last=1: only v3 is left once it serves
    assert [p.name for _, p in list_versions(tmp_path)] == ["v000003"] and engine.value == 3


def test_disk_sync_with_an_sglang_style_client(tmp_path):
    class Client:  # SGLangClient's method name and error style
        urls = ["http://s0:30000", "http://s1:30001"]
        calls = []

        def update_weights_from_disk(self, path, version=None):
            self.calls.append((path, version))
            if version == "2":
                raise RuntimeError("weight update failed on every server: http://s0:30000: bad shard")

    sync, client = DiskSync(tmp_path), Client()
    sync.sync(1, exporter(1), client)
    assert client.calls == [(str(tmp_path / "v000001"), "1")]
    with pytest.raises(WeightSyncError, match=r"Client\(http://s0:30000, http://s1:30001\) refused weight version 2"):
        sync.sync(2, exporter(2), client)


def test_disk_sync_clears_crash_leftovers_and_refuses_to_overwrite_the_served_version(tmp_path):
    (tmp_path / "v000005.tmp").mkdir(parents=True)
    (tmp_path / "v000005.tmp" / "junk").write_text("half-written")
    engine, sync = FakeEngine(), DiskSync(tmp_path)
    sync.sync(5, exporter(5), engine)
    assert not (tmp_path / "v000005.tmp").exists() and engine.value == 5
    with pytest.raises(WeightSyncError, match="serves"):
        sync.sync(5, exporter(5), engine)
    assert engine.value == 5 and (tmp_path / "v000005" / "config.json").is_file()


# ----------------------------------------------------------------------------- TensorSync (one rank)

class TensorEngine:
    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def update_weights_from_tensors(self, pairs, version=None):
        if self.fail:
            raise ValueError("unknown parameter 'x'")
        self.calls.append(([n for n, _ in pairs], version))


def test_tensor_sync_single_process():
    tensors = [("a", torch.ones(4)), ("b", torch.zeros(2, 2)), ("c", torch.ones(8))]
    eng = TensorEngine()
    assert TensorSync(bucket_bytes=20).sync(3, tensors, eng) == 3
    assert eng.calls == [(["a", "b", "c"], "3")]  # atomic: one call
    eng = TensorEngine()
    TensorSync(bucket_bytes=20, atomic=False).sync(4, dict(tensors), eng)
    assert eng.calls == [(["a"], None), (["b"], None), (["c"], "4")]  # version with the last bucket
    with pytest.raises(WeightSyncError, match="TensorEngine refused weight version 5.*unknown parameter"):
        TensorSync().sync(5, tensors, TensorEngine(fail=True))
    with pytest.raises(WeightSyncError, match="produced by ranks"):
        TensorSync().sync(6, tensors + [("a", torch.ones(1))], TensorEngine())


# ----------------------------------------------------------------------------- NcclSync over gloo

def _fake_sglang(port: int, ready) -> None:
    """A stand-in SGLang server: the weight-update endpoints, receiving as SGLang does (tp 1)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import torch.distributed as dist

    from moe_rl.rollout.weight_sync import new_custom_group

    state = {"pg": None, "weights": {}, "versions": [], "payloads": [], "session": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, body, status=200):
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            self._reply({"versions": state["versions"], "payloads": state["payloads"],
                         "weights": {k: [str(v.dtype), list(v.shape), v.float().flatten().tolist()]
                                     for k, v in state["weights"].items()}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path == "/refuse_next_init":  # the test's switch
                state["refuse"] = True
                return self._reply({"success": True})
            if self.path == "/init_weights_update_group" and state.pop("refuse", False):  # as for a name in use
                return self._reply({"success": False, "message": "Failed to initialize custom process group: "
                                    "The specified group name has already been created"}, 400)
            if self.path == "/init_weights_update_group":
                state["pg"] = new_custom_group(body["backend"], f"tcp://{body['master_address']}:"
                                               f"{body['master_port']}", body["world_size"], body["rank_offset"],
                                               body["group_name"])
                return self._reply({"success": True, "message": "ok"})
            if self.path in ("/begin_weight_update", "/end_weight_update"):  # SGLang refuses a 2nd begin, a lone end
                opening = self.path.startswith("/begin")
                if state["session"] == (1 if opening else 0):
                    return self._reply({"success": False, "message": "session state"}, 400)
                state["session"] = 1 if opening else 0
                return self._reply({"success": True, "message": "Success"})
            if self.path == "/update_weights_from_distributed":
                if state["session"] != 1:
                    return self._reply({"success": False, "message": "outside a session"}, 400)
                state["payloads"].append(body)
                if body.get("load_format") == "flattened_bucket":
                    size = sum(torch.Size(s).numel() * getattr(torch, d).itemsize
                               for d, s in zip(body["dtypes"], body["shapes"]))
                    flat = torch.empty(size, dtype=torch.uint8)
                    dist.broadcast(flat, src=0, group=state["pg"])
                    got = _sglang_receive(body, flat)
                else:
                    got = []
                    for n, d, s in zip(body["names"], body["dtypes"], body["shapes"]):
                        t = torch.empty(s, dtype=getattr(torch, d))
                        dist.broadcast(t, src=0, group=state["pg"])
                        got.append((n, t))
                state["weights"].update({n: t.clone() for n, t in got})
                if body.get("weight_version") is not None:
                    state["versions"].append(body["weight_version"])
                return self._reply({"success": True, "message": "Succeeded to update parameter online."})
            return self._reply({"detail": "Not Found"}, 404)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    ready.set()
    server.serve_forever()


def test_nccl_sync_protocol_against_a_fake_sglang_over_gloo():
    port = free_port()
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_fake_sglang, args=(port, ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(60)
        url = f"http://127.0.0.1:{port}"
        sync = NcclSync([url], master_address="127.0.0.1", master_port=free_port(), backend="gloo",
                        bucket_bytes=64, group_name="test_group")
        g = torch.Generator().manual_seed(1)
        weights = {"model.embed_tokens.weight": torch.randn(6, 4, generator=g),
                   "model.norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),
                   "lm_head.weight": torch.randn(4, 4, generator=g)}
        assert sync.sync(1, weights.items()) == 3
        sync.load_format = None  # per-tensor broadcasts, same group
        weights2 = {k: v + 1 for k, v in weights.items()}
        sync.sync(2, weights2.items())
        with urllib.request.urlopen(url + "/", timeout=10) as r:
            seen = json.loads(r.read())
        assert seen["versions"] == ["1", "2"]
        first = [p for p in seen["payloads"] if p.get("load_format") == "flattened_bucket"]
        assert len(first) >= 2 and [p["weight_version"] for p in first][-1] == "1"
        assert [p["flush_cache"] for p in first] == [False] * (len(first) - 1) + [True]
        for name, t in weights2.items():
            dtype, shape, values = seen["weights"][name]
            assert dtype == str(t.dtype) and shape == list(t.shape)
            assert torch.equal(torch.tensor(values).to(t.dtype).reshape(t.shape), t)
        sync.urls = sync.urls + ["http://127.0.0.1:9"]  # a dead server: a clear error, no hang
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"weight version 3: server "
                                                  r"http://127.0.0.1:9"):
            sync.sync(3, weights.items())
        assert time.monotonic() - t0 < 10
        # a server that refuses to join answers at once: the trainer stops waiting for the group then,
        # not after the group timeout (10 minutes)
        urllib.request.urlopen(urllib.request.Request(url + "/refuse_next_init", data=b"{}", method="POST"),
                               timeout=10).read()
        fresh = NcclSync([url], master_address="127.0.0.1", master_port=free_port(), backend="gloo")
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="has already been created"):
            fresh.sync(4, weights.items())
        assert time.monotonic() - t0 < 10
    finally:
        proc.kill()
        proc.join(10)
