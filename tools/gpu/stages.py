"""The Python stages of the prepared GPU check (tools/gpu_check.sh, run by tools/gpu/driver.py).

    python tools/gpu/stages.py STAGE --work DIR --figures FILE [options]

Each stage writes its figures to FILE as JSON, with "status" ("pass" / "fail" / "skip") and "reason",
and exits 0 unless it failed. Stages:

- environment: versions of Python, torch, CUDA, the GPU, megatron-core, transformer-engine,
  transformers and sglang (with the import error of those that do not import), and the wheel install.
- update-mfu: `tools/bench/gpu_update.py` (moe_rl's update step and bare megatron-core's, bf16) on
  its Qwen3-MoE shape cut to `--layers` layers to fit the lease; its report goes to `--report`.
- r3-decode: a server (`--engine local`: `moe-rl serve`; sglang) on the trainer's GPU decodes
  `--new-tokens` tokens per sample (ignore_eos); the trainer's routes and log-probs of the same tokens
  against the engine's (tools/gpu/engine_check.py), with R3 replay.
- weight-sync: seconds of `rollout.weight_sync` disk (export + the server's load), tensor (into a
  `LocalEngine` in this process; local only) and the nccl protocol (`NcclSync`) with backend gloo,
  since NCCL refuses two ranks on one GPU and the server shares the trainer's. Before each push the
  trainer takes an optimizer step, so the engine's log-probs must be off before the push and equal
  the trainer's after it: the server holds the pushed weights.

Without CUDA a stage fails ("no CUDA device"), unless GPU_CHECK_ALLOW_CPU=1 (the CPU tests run the
stages that way: the same code on gloo and the CPU). torch and moe_rl are imported by the stage
bodies only, so `build_parser` (the driver's dry run) needs neither.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# R3 engine vs trainer bounds (mean |d log p|, decode route mismatch), by engine: fp32 `moe-rl serve`
# as tests/gpu bounds the GPU policy against HF; SGLang as this check always bounded it (0.05).
LIMITS = {"local": (1e-3, 0.01), "sglang": (0.05, 0.05)}
# Before a push the trainer is one Adam step (lr 1e-2) ahead of the engine: its log-probs must be off by
# more than this many times the bound, or a post-push match would prove nothing.
PRE_PUSH_FACTOR = 10.0


class Skip(Exception):
    """The stage cannot run here (its reason is the message)."""


def _import_version(name: str) -> str:
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        return f"not available: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return str(getattr(mod, "__version__", "?"))


def require_device(engine: str = "local") -> str:
    """"cuda", or "cpu" under GPU_CHECK_ALLOW_CPU=1; Skip when an SGLang stage's sglang does not import."""
    if engine == "sglang":
        version = _import_version("sglang")
        if version.startswith("not available"):
            raise Skip(f"sglang does not import ({version[15:]}): its CUDA wheels are not on this machine")
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("GPU_CHECK_ALLOW_CPU") == "1":
        return "cpu"
    raise RuntimeError("no CUDA device (torch.cuda.is_available() is False)")


# ----------------------------------------------------------------------------- environment

def environment(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    figs: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                            "wheels_install_s": float(os.environ.get("SETUP_S") or 0.0),
                            "wheels_problem": os.environ.get("SETUP_PROBLEM") or None}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()  # a tuple in torch 2.x, an int before
        figs.update(device=p.name, device_count=torch.cuda.device_count(), memory_gib=round(p.total_memory / 2**30, 1),
                    capability=f"{p.major}.{p.minor}",
                    nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
    for key, mod in (("megatron_core", "megatron.core"), ("transformer_engine", "transformer_engine"),
                     ("transformers", "transformers"), ("sglang", "sglang")):
        figs[key] = _import_version(mod)
    problems = [p for p, bad in (("no CUDA device", not figs["cuda_available"]),
                                 (f"megatron-core {figs['megatron_core']}", figs["megatron_core"].startswith("not")),
                                 (f"wheel install: {figs['wheels_problem']}", figs["wheels_problem"])) if bad]
    return {"status": "fail" if problems else "pass", "reason": "; ".join(problems) or
            f"{figs.get('device', 'CPU')}, torch {figs['torch']}, megatron-core {figs['megatron_core']}", **figs}


# ----------------------------------------------------------------------------- update MFU

def update_mfu(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    sys.path.insert(0, str(HERE.parent / "bench"))
    import gpu_update

    from moe_rl.dist.ports import free_port
    from moe_rl.dist.spawn import set_local_rank_env

    device = require_device()
    if device == "cuda":
        shape, dtype = gpu_update.GPU_SHAPE.with_(num_hidden_layers=args.layers), "bf16"
        batch, seq, micro, warmup, iters = args.batch, args.seq, args.micro, args.warmup, args.iters
    else:  # the bench's own dry-run sizes
        shape, dtype, batch, seq, micro, warmup, iters = gpu_update.DRY_SHAPE, "fp32", 4, 32, 2, 0, 1
    if "RANK" not in os.environ:
        set_local_rank_env(0, 1, free_port())
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        res = gpu_update.run(shape, batch, seq, micro, warmup, iters, dtype, True, Path(tmp))
    if args.report:
        Path(args.report).write_text(gpu_update.report(shape, batch, seq, micro, args.peak_tflops, dtype, iters, res))
    peak = args.peak_tflops * 1e12
    upd, fwd = gpu_update.flops(shape, batch, seq, True), gpu_update.flops(shape, batch, seq, False)
    figs: dict[str, Any] = {
        "shape": shape.label, "params_b": shape.params() / 1e9, "active_params_b": shape.params(active=True) / 1e9,
        "dtype": dtype, "tokens": batch * seq, "iters": iters, "setup_s": res["setup_s"],
        "update_s": res["update_s"], "logprobs_s": res["logprobs_s"],
        "update_mfu": upd / res["update_s"] / peak, "logprobs_mfu": fwd / res["logprobs_s"] / peak,
        "update_tokens_per_s": batch * seq / res["update_s"], "packed_over_padded": res["padded_s"] / res["packed_s"],
        "update_gib": res["update_mb"] / 1024,
    }
    if "bare_s" in res:
        figs.update(bare_s=res["bare_s"], bare_mfu=upd / res["bare_s"] / peak,
                    moe_rl_over_bare=res["update_s"] / res["bare_s"])
        return {"status": "pass", "reason": f"moe_rl / bare update time {figs['moe_rl_over_bare']:.3f}", **figs}
    return {"status": "fail", "reason": f"bare megatron-core update: {res.get('bare_error', 'not measured')}", **figs}


# ----------------------------------------------------------------------------- serving stages

def _serving(args: argparse.Namespace, hf_dir: Path, body: Callable[[Any, Any], dict[str, Any]]) -> dict[str, Any]:
    """Start the server on `hf_dir`, build the policy meanwhile, run `body(group, policy)`, stop the server."""
    import engine_check as ec

    group = ec.launch(args.engine, hf_dir, Path(args.work) / "servers", args.mem_fraction)
    try:
        ec.one_rank()
        policy = ec.build_policy(hf_dir)
        group.wait_healthy(timeout=args.server_timeout)
        return body(group, policy)
    finally:
        group.stop()


def r3_decode(args: argparse.Namespace) -> dict[str, Any]:
    import engine_check as ec

    from moe_rl.testing import make_tiny_qwen3_moe

    device = require_device(args.engine)
    hf = make_tiny_qwen3_moe(Path(args.work) / "model", seed=0)
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]

    def body(group: Any, policy: Any) -> dict[str, Any]:
        client = ec.client(group)
        try:
            results = ec.generate(client, ec.prompts(args.samples, args.prompt_len, vocab), args.new_tokens, seed=1)
        finally:
            client.close()
        return ec.compare(policy, results)

    figs = {"engine": args.engine, "device": device, **_serving(args, hf, body)}
    logp_limit, route_limit = LIMITS[args.engine]
    problems = ec.judge(figs, logp_limit, route_limit)
    return {"status": "fail" if problems else "pass", "reason": "; ".join(problems) or
            f"R3 log-probs within {logp_limit:g}, decode routes within {route_limit:g} over "
            f"{args.new_tokens} decoded tokens", **figs}


def weight_sync(args: argparse.Namespace) -> dict[str, Any]:
    import engine_check as ec

    sys.path.insert(0, str(HERE.parent / "bench"))
    from common import BASE, write_model

    device = require_device(args.engine)
    shape = BASE.with_(hidden_size=args.hidden, moe_intermediate_size=args.hidden, num_experts=args.experts,
                       vocab_size=args.vocab)
    hf = Path(write_model(Path(args.work) / "model", shape))  # the server trusts the model's parent: versions/ too
    figs: dict[str, Any] = {"engine": args.engine, "device": device, "params_m": shape.params() / 1e6,
                            "shape": shape.label}

    def body(group: Any, policy: Any) -> dict[str, Any]:
        import torch

        figs["weights_mb"] = sum(t.numel() * t.element_size() for _, t in policy.hf_tensors()) / 2**20
        train_seqs = [torch.tensor(s) for s in ec.prompts(8, 32, args.vocab, seed=7)]
        asks = ec.prompts(args.samples, args.prompt_len, args.vocab, seed=3)
        problems: list[str] = []
        methods = ["disk", "nccl_gloo", "nccl_gloo_delta"] + (["tensor"] if args.engine == "local" else [])
        version = 0
        for method in methods:
            engine = sync = None
            seconds, pre, post = [], [], []
            try:
                engine, sync = _sync_target(method, group, hf, device)
                for _ in range(args.pushes):
                    ec.update_step(policy, train_seqs)
                    version += 1
                    pre.append(ec.compare(policy, ec.generate(engine, asks, args.new_tokens, seed=version)))
                    _sync_device()
                    t0 = time.perf_counter()
                    sync.sync(version, policy, engine)
                    _sync_device()
                    seconds.append(time.perf_counter() - t0)
                    post.append(ec.compare(policy, ec.generate(engine, asks, args.new_tokens, seed=version)))
            except Exception as e:  # noqa: BLE001 - one method's failure must not hide the others'
                problems.append(f"{method}: {type(e).__name__}: {str(e)[:300]}")
            finally:
                for part in (sync, engine):
                    if part is not None:
                        part.close()
            problems += _push_problems(method, figs, seconds, pre, post, LIMITS[args.engine])
        return {"problems": problems}

    problems = _serving(args, hf, body)["problems"]
    return {"status": "fail" if problems else "pass", "reason": "; ".join(problems) or
            "every push changed the served weights to the trainer's", **figs}


def _sync_target(method: str, group: Any, hf: Path, device: str) -> tuple[Any, Any]:
    """(engine, weight sync) of one method, the sync made by the product's factory from its
    `rollout.weight_sync` value: the servers' client for disk and nccl (its backend gloo), a
    `LocalEngine` on this process's device for tensor (rollout.engine=inprocess)."""
    import engine_check as ec

    from moe_rl.dist.ports import free_port
    from moe_rl.rollout.config import RolloutConfig
    from moe_rl.rollout.weight_sync import make_weight_sync

    if method == "tensor":
        from moe_rl.rollout.local_engine import LocalEngine

        sync = make_weight_sync(RolloutConfig(engine="inprocess", weight_sync="tensor"))
        return LocalEngine(str(hf), device=device), sync
    if method == "disk":
        return ec.client(group), make_weight_sync(RolloutConfig(weight_sync="disk"), root=hf.parent / "versions",
                                                  keep_last=1)
    # nccl_gloo_delta: after its first push only what changed (rollout.weight_sync_delta); both verified
    cfg = RolloutConfig(weight_sync="nccl", weight_sync_delta=method.endswith("_delta"))
    return ec.client(group), make_weight_sync(cfg, admin_urls=group.admin_urls, master_address="127.0.0.1",
                                              master_port=free_port(), backend="gloo")


def _sync_device() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _push_problems(method: str, figs: dict[str, Any], seconds: list[float], pre: list[dict[str, float]],
                   post: list[dict[str, float]], limits: tuple[float, float]) -> list[str]:
    """Record a method's figures; what it got wrong: a push that left the engine's log-probs off the
    trainer's, or a trainer step that did not move them (then the match would prove nothing)."""
    logp_limit, route_limit = limits
    figs[f"{method}_s_each"] = seconds
    figs[f"{method}_s"] = statistics.median(seconds) if seconds else None
    figs[f"{method}_pre_logp_abs_diff"] = [p["logp_abs_diff_r3"] for p in pre]
    figs[f"{method}_post_logp_abs_diff"] = [p["logp_abs_diff_r3"] for p in post]
    figs[f"{method}_post_route_mismatch"] = [p["route_mismatch_decode"] for p in post]
    import engine_check as ec

    problems = []
    if any(not p["logp_abs_diff_r3"] > PRE_PUSH_FACTOR * logp_limit for p in pre):
        problems.append(f"{method}: before a push the engine was within {PRE_PUSH_FACTOR * logp_limit:g} of the "
                        f"trainer ({figs[f'{method}_pre_logp_abs_diff']}): the optimizer step did not show")
    for p in post:
        problems += [f"{method} after the push: {x}" for x in ec.judge(p, logp_limit, route_limit)]
    return problems


# ----------------------------------------------------------------------------- CLI

STAGES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "environment": environment, "update-mfu": update_mfu, "r3-decode": r3_decode, "weight-sync": weight_sync}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stages.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    for name in STAGES:
        s = sub.add_parser(name)
        s.add_argument("--work", required=True, help="scratch directory of the stage")
        s.add_argument("--figures", required=True, help="where the stage's record (JSON) goes")
        if name == "update-mfu":
            s.add_argument("--report", default=None, help="gpu_update.py's markdown report")
            s.add_argument("--layers", type=int, default=8, help="layers of gpu_update.py's 16-layer shape kept")
            s.add_argument("--batch", type=int, default=8)
            s.add_argument("--seq", type=int, default=2048)
            s.add_argument("--micro", type=int, default=2)
            s.add_argument("--warmup", type=int, default=1)
            s.add_argument("--iters", type=int, default=3)
            s.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H200: 989)")
        if name in ("r3-decode", "weight-sync"):
            s.add_argument("--engine", choices=sorted(LIMITS), default="local")
            s.add_argument("--mem-fraction", type=float, default=0.3, help="SGLang's share of the shared GPU")
            s.add_argument("--server-timeout", type=float, default=120.0, help="seconds for the server to get healthy")
            s.add_argument("--samples", type=int, default=8)
            s.add_argument("--prompt-len", type=int, default=8)
            s.add_argument("--new-tokens", type=int, default=48 if name == "r3-decode" else 16)
        if name == "weight-sync":
            s.add_argument("--pushes", type=int, default=2, help="pushes per method (the first pays for warm-up)")
            s.add_argument("--hidden", type=int, default=512, help="hidden and expert width of the synced model")
            s.add_argument("--experts", type=int, default=32)
            s.add_argument("--vocab", type=int, default=8192)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        record = STAGES[args.stage](args)
    except Skip as e:
        record = {"status": "skip", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - the record says what broke; the traceback goes to the log
        traceback.print_exc()
        record = {"status": "fail", "reason": f"{type(e).__name__}: {str(e)[:500]}"}
    record["stage_s"] = round(time.monotonic() - t0, 1)
    Path(args.figures).write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(json.dumps(record, default=str))
    return 1 if record["status"] == "fail" else 0


if __name__ == "__main__":
    raise SystemExit(main())
