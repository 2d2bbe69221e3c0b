"""Weight sync end to end: megatron policy on 2 gloo ranks (EP2) -> rollout engines on rank 0.

The trainer's weights are changed in process, then synced by disk (into an
in-process LocalEngine, and over HTTP through SGLangClient into `moe-rl serve`'s
app) and by TensorSync; afterwards the engines score fixed sequences exactly as
the trainer does (|Δ log p| ≤ 1e-4). Corrupt weights are refused and the engines
keep serving the previous version. One run_ranks call does all of it.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch

from moe_rl.policy.parity import sample_sequences
from moe_rl.testing import run_ranks

TOL = 1e-4


def _perturb(chunks: list[Any], seed: int, std: float = 0.02) -> None:
    """Add noise that depends only on (seed, parameter name, shard coordinates).

    Dense parameters are replicated over the data-parallel ranks and get the same
    noise there; expert parameters get noise per expert-parallel rank.
    """
    from megatron.core import parallel_state as ps

    tp, ep = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                key = f"{seed}|{name}|tp{tp}|ep{ep if '.experts.' in name else 0}"
                g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                p.add_(torch.randn(p.shape, generator=g) * std)


@torch.no_grad()
def _engine_logp(engine: Any, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """Teacher-forced log p(token t+1 | tokens ..t) under the engine's HF model, `[T_i - 1]` each."""
    out = []
    for seq in sequences:
        logits = engine.model(input_ids=seq.unsqueeze(0)).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, seq[1:, None]).squeeze(-1))
    return out


def _max_diff(trainer: torch.Tensor, engine: list[torch.Tensor]) -> float:
    return max(float((trainer[j, :len(e)] - e).abs().max()) for j, e in enumerate(engine))


def _corrupt_export(weights: Any):
    """A collective export that leaves a truncated safetensors file (rank 0 cuts it after the export)."""
    import torch.distributed as dist

    def export(out_dir: Path) -> None:
        weights.export(out_dir)
        if dist.get_rank() == 0:
            shard = sorted(Path(out_dir).glob("*.safetensors"))[0]
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return export


def _sync_worker(hf_dir: str, work_dir: str, sequences: list[torch.Tensor]) -> dict[str, Any]:
    import torch.distributed as dist

    from moe_rl.policy.convert import load_hf_weights
    from moe_rl.policy.forward import compute_logprobs
    from moe_rl.policy.model import build_model, read_hf_config
    from moe_rl.policy.parallel import ParallelLayout, init_distributed
    from moe_rl.rollout.local_engine import LocalEngine
    from moe_rl.rollout.server import ServerThread
    from moe_rl.rollout.sglang_client import SGLangClient
    from moe_rl.rollout.weight_sync import DiskSync, TensorSync, WeightSyncError, MegatronWeights

    layout = ParallelLayout.parse("ep2")
    arch = read_hf_config(hf_dir)
    layout.validate(arch)
    init_distributed(layout)
    chunks = build_model(arch, layout)
    load_hf_weights(chunks, hf_dir, arch)
    rank = dist.get_rank()
    weights = MegatronWeights(chunks, arch, json.loads((Path(hf_dir) / "config.json").read_text()))
    work = Path(work_dir)
    local = LocalEngine(hf_dir) if rank == 0 else None   # in-process engine
    served = LocalEngine(hf_dir) if rank == 0 else None  # behind moe-rl serve's HTTP API
    server = ServerThread(served, enable_return_routed_experts=True).start() if rank == 0 else None
    client = SGLangClient([server.url], max_attempts=1) if rank == 0 else None

    def trainer_logp() -> torch.Tensor:
        return compute_logprobs(chunks, sequences, micro_batch_size=4).logp

    out: dict[str, Any] = {"rank": rank}
    try:
        _perturb(chunks, seed=1)
        t1 = trainer_logp()
        disk_local, disk_http = DiskSync(work / "local", keep_last=2), DiskSync(work / "http", keep_last=2)
        if rank == 0:
            out["before"] = _max_diff(t1, _engine_logp(local, sequences))
        disk_local.sync(1, weights, local)
        disk_http.sync(1, weights.export, client)  # a bare export_fn works too
        if rank == 0:
            out["disk_local"] = _max_diff(t1, _engine_logp(local, sequences))
            out["disk_http"] = _max_diff(t1, _engine_logp(served, sequences))
            out["http_version"] = client.get_model_info()["weight_version"]

        for name, sync, engine in (("local", disk_local, local), ("http", disk_http, client)):
            try:
                sync.sync(2, _corrupt_export(weights), engine)
                out[f"corrupt_{name}"] = "accepted"
            except WeightSyncError as e:
                out[f"corrupt_{name}"] = str(e)
        if rank == 0:
            out["after_corrupt_local"] = _max_diff(t1, _engine_logp(local, sequences))
            out["after_corrupt_http"] = _max_diff(t1, _engine_logp(served, sequences))
            out["http_version_after_corrupt"] = client.get_model_info()["weight_version"]
            out["http_generates"] = len(client.generate([_request()])[0][0].output_ids)
            out["dirs_local"] = sorted(p.name for p in (work / "local").iterdir())

        _perturb(chunks, seed=2)
        t2 = trainer_logp()
        out["tensor_count"] = TensorSync(bucket_bytes=16 << 10).sync(3, weights, local)
        if rank == 0:
            out["tensor"] = _max_diff(t2, _engine_logp(local, sequences))
            out["tensor_version"] = local.weight_version
        # NaN in one expert's weights (new tensors: the exported ones may share the trainer's storage)
        bad = ((n, torch.full_like(t, float("nan")) if "layers.1.mlp.experts.3.up_proj" in n else t)
               for n, t in weights.named_tensors())
        try:
            TensorSync().sync(4, bad, local)
            out["tensor_corrupt"] = "accepted"
        except WeightSyncError as e:
            out["tensor_corrupt"] = str(e)
        if rank == 0:
            out["after_tensor_corrupt"] = _max_diff(t2, _engine_logp(local, sequences))
            out["tensor_version_after_corrupt"] = local.weight_version
    finally:
        if rank == 0:
            client.close()
            server.stop()
    return out


def _request():
    from moe_rl.rollout.engine import GenerateRequest, SamplingParams

    return GenerateRequest([1, 7, 3], SamplingParams(max_new_tokens=2, seed=0))


def test_weight_sync_disk_http_and_tensor(tiny_hf_dir, tmp_path):
    sequences = sample_sequences(vocab_size=128, num=4, max_len=16, seed=3)
    r0, r1 = run_ranks(_sync_worker, 2, str(tiny_hf_dir), str(tmp_path), sequences, timeout=240)
    assert r0["before"] > 1e-2  # the perturbation matters: the engine was stale before the sync
    assert r0["disk_local"] <= TOL and r0["disk_http"] <= TOL
    assert r0["http_version"] == "1"

    for name in ("local", "http"):  # same error on both ranks, naming the version dir
        for r in (r0, r1):
            assert r[f"corrupt_{name}"] != "accepted"
            assert str(tmp_path / name / "v000002") in r[f"corrupt_{name}"]
            assert "keeps serving" in r[f"corrupt_{name}"]
    assert "LocalEngine" in r0["corrupt_local"] and "http://127.0.0.1" in r0["corrupt_http"]
    assert r0["after_corrupt_local"] <= TOL and r0["after_corrupt_http"] <= TOL  # old weights still served
    assert r0["http_version_after_corrupt"] == "1" and r0["http_generates"] == 2
    assert r0["dirs_local"] == ["v000001", "v000002"]  # the served one kept, the refused one for inspection

    assert r0["tensor_count"] == r1["tensor_count"] > 0
    assert r0["tensor"] <= TOL and r0["tensor_version"] == "3"
    for r in (r0, r1):
        assert "refused weight version 4" in r["tensor_corrupt"] and "NaN" in r["tensor_corrupt"]
    assert r0["after_tensor_corrupt"] <= TOL and r0["tensor_version_after_corrupt"] == "3"


def _slow_consumer(pause: float) -> dict:
    """Rank 0 takes `pause` s with each bucket (as with a server that is slow to load it), longer than
    the default group's timeout; every rank owns tensors of every bucket."""
    import time

    import torch.distributed as dist

    from moe_rl.dist.collectives import init_control_group
    from moe_rl.rollout.weight_sync import collect_to_rank0

    init_control_group(120.0)  # what the trainer makes: the hand-offs wait as long as rank 0 needs
    me = dist.get_rank()
    mine = [(f"w{b}.r{me}", torch.full((256,), float(10 * b + me))) for b in range(4)]
    got = []
    for bucket in collect_to_rank0(mine, bucket_bytes=2 * 256 * 4, group=None):
        got.append([(m.name, float(t[0])) for m, t in zip(bucket.metas, bucket.tensors)])
        time.sleep(pause)
    return {"buckets": got}


def test_a_slow_bucket_on_rank_0_does_not_time_out_the_other_ranks_sends():
    """The owners post bucket i + 1's sends only once rank 0 has posted its receives, which it does before
    it works on bucket i: no send waits on the default group (3 s here) for rank 0's 4 s per bucket."""
    out = run_ranks(_slow_consumer, 2, 4.0, pg_timeout=3.0, timeout=120)
    names = [n for b in out[0]["buckets"] for n, _ in b]
    assert len(out[0]["buckets"]) == 4 and sorted(names) == sorted(f"w{b}.r{r}" for b in range(4) for r in (0, 1))
    assert all(v == 10 * int(n[1]) + int(n[-1]) for b in out[0]["buckets"] for n, v in b)
    assert out[1]["buckets"] == []
