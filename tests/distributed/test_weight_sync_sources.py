"""The nccl sync's sources on 4 gloo ranks -> 2 `moe-rl serve` servers: every rank sends its own share
to both servers, verified against the servers' checksums; delta pushes carry only what changed; a
server killed mid-push is restored, in full, by the next push.

The trainer ranks here hold plain tensors (a tiny checkpoint's, split four ways as a PP2 x EP2 layout
splits them: the dense tensors of each stage on one rank, each rank its own experts); the megatron
policy's sources run in the rehearsal (tests/e2e). The reference is independent of the sync: the
checkpoint's values, hashed in the test from safetensors, and each server's greedy log-probs against
transformers on the same weights.
"""
from __future__ import annotations

import os
import re
import signal
import urllib.request
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from moe_rl.testing import free_port, make_tiny_qwen3_moe, run_ranks
from moe_rl.testing.serve import start_serve_process, stop_process

BUCKET = 4096  # bytes: several buckets per rank


def _share(weights: dict[str, torch.Tensor], r: int, world: int = 4) -> list[tuple[str, torch.Tensor]]:
    """Rank r's tensors, as PP2 x EP2 splits them: layer halves by stage, experts by ep rank."""
    stage, ep = divmod(r, 2)
    out = []
    for name in sorted(weights):
        m = re.search(r"layers\.(\d+)\.", name)
        layer_stage = 0 if m is None else int(int(m.group(1)) >= 1)
        if m is None:
            layer_stage = 0 if "embed" in name else 1
        if layer_stage != stage:
            continue
        e = re.search(r"experts\.(\d+)\.", name)
        owner_ep = int(e.group(1)) % 2 if e else 0
        if owner_ep == ep:
            out.append((name, weights[name]))
    return out


def _checksums(url: str) -> dict[str, str]:
    req = urllib.request.Request(url + "/weights_checker", data=b'{"action": "checksum"}', method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["ranks"][0]["checksums"]


def _push_worker(urls: list[str], new_dir: str, kill_pid: int, restart: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from moe_rl.rollout.weight_sync import NcclSync, WeightSyncError, tensor_checksum

    me = dist.get_rank()
    calls = {"objects": 0}  # object collectives among the trainer ranks: each is a round trip for all of them

    def counted(fn):
        def wrapper(*a, **k):
            calls["objects"] += 1
            return fn(*a, **k)
        return wrapper
    dist.all_gather_object = counted(dist.all_gather_object)
    dist.broadcast_object_list = counted(dist.broadcast_object_list)
    new = load_file(str(Path(new_dir) / "model.safetensors"))
    mine = _share(new, me)
    sync = NcclSync(urls, master_address="127.0.0.1", master_port=free_port() if me == 0 else 1, backend="gloo",
                    bucket_bytes=BUCKET, group_name="sources", http_timeout=60.0, delta=True, verify=True)
    out: dict[str, Any] = {"rank": me, "share_bytes": sum(t.nbytes for _, t in mine), "names": [n for n, _ in mine]}

    total = sync.sync(1, mine)                                   # full, from 4 sources, verified
    out["total"], out["full1"] = total, vars(sync.stats).copy()

    changed = {n: t.clone() for n, t in mine}                    # a few elements of a few tensors move
    for i, name in enumerate(sorted(changed)):
        if i % 3 == 0:
            changed[name].view(-1)[:: max(1, changed[name].numel() // 3)] += 0.5
    before = calls["objects"]
    sync.sync(2, list(changed.items()))                          # delta, element-wise to moe-rl serve
    out["delta2"] = vars(sync.stats).copy()
    out["objects2"] = calls["objects"] - before
    out["sums2"] = {n: tensor_checksum(t) for n, t in changed.items()}

    def dying() -> Any:                                          # server 2 dies after rank 0's first tensor
        for k, (n, t) in enumerate(mine):
            if me == 0 and k == 1:
                os.kill(kill_pid, signal.SIGKILL)
            yield n, t + 1.0
    try:
        sync.sync(3, dying())
        out["error3"] = None
    except WeightSyncError as e:
        out["error3"] = str(e)
    if me == 0:                                                  # it comes back on its port, with its old weights
        srv = start_serve_process(restart["model"], "--health-check-timeout", "10", port=restart["port"])
        out["restarted_pid"] = srv.proc.pid
    dist.barrier()
    sync.sync(4, list(changed.items()))                          # the base is unknown: full, verified
    out["push4"] = vars(sync.stats).copy()
    sync.close()
    return out


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory):
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_seed1"), seed=1)


def test_four_sources_two_servers_delta_verify_and_a_server_killed_mid_push(tiny_hf_dir, new_dir):
    servers = [start_serve_process(tiny_hf_dir, "--health-check-timeout", "10") for _ in range(2)]
    restarted = None
    try:
        port2 = int(servers[1].url.rsplit(":", 1)[1])
        res = run_ranks(_push_worker, 4, [s.url for s in servers], str(new_dir), servers[1].proc.pid,
                        {"model": str(tiny_hf_dir), "port": port2}, timeout=600)
        restarted = res[0].get("restarted_pid")
        weights = load_file(str(Path(new_dir) / "model.safetensors"))
        # every tensor comes from exactly one source, and every rank sends only its own share
        assert sorted(n for r in res for n in r["names"]) == sorted(weights)
        assert res[0]["total"] == len(weights)
        for r in res:
            st = r["full1"]
            assert st["full"] and st["tensors"] == len(r["names"])
            last_word = min(weights[n].nbytes for n in r["names"]) * 2 if r["rank"] == 0 else 0
            assert st["sent_bytes"] == 2 * r["share_bytes"] + last_word   # one copy per server, nothing more
            assert st["messages"] == 2 * 2 * st["buckets"] + (4 if r["rank"] == 0 else 0)
        # push 2: only the changed elements went, and both servers hold them
        for r in res:
            d = r["delta2"]
            assert not d["full"] and d["sparse_tensors"] >= 1 and d["sent_tensors"] < d["tensors"]
            assert d["sent_bytes"] <= 0.1 * 2 * d["full_bytes"] + 2 * 4096
            # the push's control traffic: rank 0's plan, one gather of every outcome, one verdict, and
            # verify's gather of checksums and its verdict (the push's metrics ride on the verdict)
            assert r["objects2"] == 5, r["objects2"]
        # push 3 failed on every rank, naming the dead server; push 4 was full and verified
        assert all(r["error3"] and servers[1].url in r["error3"] for r in res), [r["error3"] for r in res]
        assert all(r["push4"]["full"] for r in res)
        want = {n: s for r in res for n, s in r["sums2"].items()}
        for url in (servers[0].url, servers[1].url):
            held = _checksums(url)
            assert {n: held[n] for n in want} == want, url
    finally:
        for s in servers:
            stop_process(s.proc)
        if restarted:
            try:
                os.kill(restarted, signal.SIGKILL)
            except OSError:
                pass
