"""Update-step and log-prob throughput of a 1-3B-parameter Qwen3-MoE-shaped model on one GPU, with MFU.

The model is randomly initialised (nothing downloaded): megatron builds it from a
config, `export_hf` writes it as a bf16 HF checkpoint, and a `Policy` loads that,
as training would. transformer-engine's layer spec is used when it imports (else
the local spec), with the alltoall dispatcher. Measured, each after warm-up steps:

- update:   `Policy.update` (forward, loss, backward, optimizer) on B x T tokens;
- logprobs: `Policy.logprobs` (forward only) on the same batch;
- bare:     the same update written directly against megatron-core
            (`overhead.BareStep`), built after the policy is freed.

MFU = model FLOPs / time / peak. Model FLOPs per token: 6·N for an update and 2·N
for a forward, N = parameters a token multiplies (attention, router, its top-k
experts, output layer; not the embedding lookup); plus attention scores,
12·L·d_attn·T per token for an update and 4·L·d_attn·T for a forward (d_attn =
heads × head_dim, full T x T as in the PaLM/Megatron formula, causal masking not
subtracted). Peak: `--peak-tflops` (H200 dense bf16: 989).

    python tools/bench/gpu_update.py --out $OUT/gpu_bench.md      # on a GPU (see tools/gpu_bench.sh)
    python tools/bench/gpu_update.py --dry-run                    # tiny model on CPU, one step each
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import Shape

# 2.4B parameters, 0.99B active per token (0.68B of them in matmuls, the rest the embedding
# table); Qwen3-MoE's fine-grained experts (64, top-8) and its tokenizer's vocabulary, with
# fewer layers and narrower experts to fit 1-3B.
GPU_SHAPE = Shape(vocab_size=151936, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8,
                  moe_intermediate_size=256, max_position_embeddings=4096)
DRY_SHAPE = Shape(vocab_size=128, hidden_size=64, num_hidden_layers=2, head_dim=16, num_experts=4,
                  moe_intermediate_size=32, max_position_embeddings=256)


def hf_config(shape: Shape) -> dict[str, Any]:
    """The HF config.json of `shape` (Qwen3-MoE keys; no transformers needed)."""
    from moe_rl.policy.tiny import TinyMoEConfig

    cfg = asdict(TinyMoEConfig(intermediate_size=4 * shape.hidden_size, **asdict(shape)))
    return {**cfg, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}


def write_random_checkpoint(shape: Shape, out_dir: Path, dtype: str) -> str:
    """Build `shape` with megatron's random init on this device and export it as a HF checkpoint."""
    from moe_rl.policy.convert import export_hf
    from moe_rl.policy.model import arch_from_hf_dict, build_model

    cfg = hf_config(shape)
    arch = arch_from_hf_dict(cfg)
    chunks = build_model(arch, common.layout_for("single"), dtype)
    export_hf(chunks, out_dir, arch, cfg)
    del chunks
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return str(out_dir)


def flops(shape: Shape, batch: int, seq: int, update: bool) -> float:
    """Model FLOPs of one update (`update`) or one forward pass over batch x seq tokens."""
    n = shape.params(active=True) - shape.vocab_size * shape.hidden_size  # the embedding is a lookup
    d_attn = shape.num_attention_heads * shape.head_dim
    per_token = (6 if update else 2) * n + (12 if update else 4) * shape.num_hidden_layers * d_attn * seq
    return per_token * batch * seq


def _timed(fn: Any, warmup: int, iters: int) -> tuple[float, float]:
    """(median seconds, peak memory MiB above the start) of `fn` over `iters` calls after `warmup`."""
    with common.PeakAbove() as peak:
        t = common.interleave({"fn": fn}, iters, warmup)
    return common.median(t.wall["fn"]), peak.mb


def _policy_passes(hf_dir: str, layout: Any, seqs: list[torch.Tensor], micro: int, dtype: str, warmup: int,
                   iters: int) -> dict[str, float]:
    """Log-prob and update timings of a Policy; it is freed when this returns."""
    policy = common.make_policy(hf_dir, layout, micro, dtype=dtype)
    loss = common.token_loss(len(seqs) * (len(seqs[0]) - 1))
    res: dict[str, float] = {}
    res["logprobs_s"], res["logprobs_mb"] = _timed(lambda: policy.logprobs(seqs), warmup, iters)
    res["update_s"], res["update_mb"] = _timed(lambda: policy.update(seqs, {}, loss), warmup, iters)
    # A realistic length spread (T/8 .. T): padded micro-batches vs rows packed to T tokens.
    seq = len(seqs[0])
    g = torch.Generator().manual_seed(1)
    spread = [s[: int(n)] for s, n in zip(seqs, torch.randint(max(seq // 8, 2), seq + 1, (len(seqs),), generator=g))]
    res["spread_tokens"] = sum(len(s) for s in spread)
    spread_loss = common.token_loss(res["spread_tokens"])
    padded, packed = policy.spec, dataclasses.replace(policy.spec, max_tokens_per_microbatch=seq)
    for name, spec in (("padded", padded), ("packed", packed)):
        policy.spec = spec
        res[f"{name}_s"], res[f"{name}_mb"] = _timed(lambda: policy.update(spread, {}, spread_loss), warmup, iters)
    return res


def run(shape: Shape, batch: int, seq: int, micro: int, warmup: int, iters: int, dtype: str, bare: bool,
        work: Path) -> dict[str, Any]:
    import overhead

    layout = common.layout_for("single")
    common.setup(layout)
    start = time.perf_counter()
    hf_dir = write_random_checkpoint(shape, work / "model", dtype)
    seqs = common.random_batch(batch, seq, shape.vocab_size)
    res: dict[str, Any] = {"setup_s": time.perf_counter() - start}
    res.update(_policy_passes(hf_dir, layout, seqs, micro, dtype, warmup, iters))
    gc.collect()
    if bare:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            step = overhead.BareStep(*overhead.bare_model(hf_dir, layout, dtype), seqs, micro, batch * (seq - 1))
            res["bare_s"], res["bare_mb"] = _timed(step, warmup, iters)
        except torch.cuda.OutOfMemoryError as e:  # report it; the policy numbers stand on their own
            res["bare_error"] = f"out of memory: {str(e).splitlines()[0]}"
    return res


def report(shape: Shape, batch: int, seq: int, micro: int, peak_tflops: float, dtype: str, iters: int,
           res: dict[str, Any]) -> str:
    from moe_rl.policy.model import use_transformer_engine

    tokens = batch * seq
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (dry run)"
    upd, fwd = flops(shape, batch, seq, True), flops(shape, batch, seq, False)
    n = shape.params(active=True) - shape.vocab_size * shape.hidden_size

    def line(name: str, seconds: float, f: float, mb: float) -> list[str]:
        return [name, f"{seconds:.3f}", f"{tokens / seconds:,.0f}", f"{f / seconds / 1e12:.1f}",
                f"{f / seconds / (peak_tflops * 1e12) * 100:.1f}%", f"{mb / 1024:.1f}"]

    rows = [line("update (moe_rl Policy.update)", res["update_s"], upd, res["update_mb"]),
            line("log-probs (Policy.logprobs, forward only)", res["logprobs_s"], fwd, res["logprobs_mb"])]
    if "bare_s" in res:
        rows.append(line("update (bare megatron-core)", res["bare_s"], upd, res["bare_mb"]))
    spread = [[f"update, lengths {max(seq // 8, 2)}..{seq}, {name}", f"{res[f'{name}_s']:.3f}",
               f"{res['spread_tokens'] / res[f'{name}_s']:,.0f}", f"{res[f'{name}_mb'] / 1024:.1f}"]
              for name in ("padded", "packed")]
    versions = [f"torch {torch.__version__}"]
    for mod in ("megatron.core", "transformer_engine"):
        try:
            versions.append(f"{mod} {getattr(__import__(mod, fromlist=['_']), '__version__', '?')}")
        except ImportError:
            versions.append(f"{mod} not installed")
    spec = "transformer-engine" if use_transformer_engine() else "local"
    paragraphs = [
        "# GPU update-step benchmark",
        f"Device: {device}; {', '.join(versions)}; layer spec: {spec}; {dtype}.",
        (f"Model: Qwen3-MoE-shaped, {shape.label}, {shape.num_attention_heads} heads / "
         f"{shape.num_key_value_heads} KV heads x {shape.head_dim}; {shape.params() / 1e9:.2f}B parameters, "
         f"{shape.params(active=True) / 1e9:.2f}B active per token (random init)."),
        (f"Batch: {batch} sequences x {seq} tokens = {tokens:,} tokens, microbatches of {micro}; median of "
         f"{iters} timed steps after warm-up; setup (init, export, load) {res['setup_s']:.0f} s."),
        common.md_table(["pass", "median s", "tokens/s", "model TFLOP/s", "MFU", "peak GiB above start"], rows),
        (f"moe_rl update / bare megatron-core update: {res['update_s'] / res['bare_s']:.3f}x." if "bare_s" in res
         else f"bare megatron-core update: {res.get('bare_error', 'not run')}."),
        (f"Packing: the same {batch} sequences cut to lengths uniform in [{max(seq // 8, 2)}, {seq}] "
         f"({res['spread_tokens']:,} real tokens), padded micro-batches of {micro} vs rows packed to {seq} "
         f"tokens: packed / padded real tokens/s = {res['padded_s'] / res['packed_s']:.2f}x."),
        common.md_table(["pass", "median s", "real tokens/s", "peak GiB above start"], spread),
        (f"MFU = model FLOPs / s / {peak_tflops:g} TFLOP/s. Model FLOPs: update 6·N·tokens + "
         f"12·L·d_attn·T·tokens, forward 2·N·tokens + 4·L·d_attn·T·tokens; N = {n / 1e9:.3f}B (attention, "
         f"router, top-{shape.num_experts_per_tok} experts, output layer; not the embedding lookup), "
         f"L = {shape.num_hidden_layers}, d_attn = {shape.num_attention_heads * shape.head_dim}, T = {seq}; "
         f"{upd / 1e12:.1f} TFLOP per update, {fwd / 1e12:.1f} TFLOP per forward."),
    ]
    return "\n\n".join(paragraphs) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU, one step of each pass")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro", type=int, default=2, help="sequences per microbatch")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-bare", action="store_true", help="skip the bare megatron-core comparison")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the device")
    p.add_argument("--out", default=None, help="also write the report (markdown) here")
    a = p.parse_args(argv)
    if a.dry_run:
        shape, dtype, a.batch, a.seq, a.micro, a.warmup, a.iters = DRY_SHAPE, "fp32", 4, 32, 2, 0, 1
    elif not torch.cuda.is_available():
        p.error("no GPU: run with --dry-run on CPU")
    else:
        shape, dtype = GPU_SHAPE, "bf16"
    if "MASTER_PORT" not in os.environ:  # one process: its own group on a free local port
        from moe_rl.dist.ports import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    with tempfile.TemporaryDirectory() as tmp:
        res = run(shape, a.batch, a.seq, a.micro, a.warmup, a.iters, dtype, not a.no_bare, Path(tmp))
    text = report(shape, a.batch, a.seq, a.micro, a.peak_tflops, dtype, a.iters, res)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
