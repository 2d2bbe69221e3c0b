"""`moe-rl check-parity`: is this parallel layout numerically sound for my model?

For each layout, local processes (gloo on CPU) build the megatron model from a HF
checkpoint, compute per-token log-probs of a fixed set of token sequences, and the
results are compared with HF transformers on the same weights. The workers here
are also what the test suite uses for layout parity, gradient parity and the
HF -> megatron -> HF round trip.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from moe_rl.policy.families.registry import read_hf_config
from moe_rl.policy.parallel import LayoutError, ParallelLayout

DEFAULT_LAYOUTS = "tp2,pp2,ep2,tp2-ep2,tp2-pp2,pp2-vpp2,dp2"


def sample_sequences(vocab_size: int, num: int = 8, max_len: int = 24, seed: int = 0) -> list[torch.Tensor]:
    """Deterministic token sequences of varied lengths (2..max_len) for parity checks."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, max_len + 1, (num,), generator=g)
    lengths[0] = max_len
    return [torch.randint(0, vocab_size, (int(n),), generator=g) for n in lengths]


@torch.no_grad()
def hf_logprobs(hf_dir: str | Path, sequences: list[torch.Tensor], lora: str | None = None) -> list[torch.Tensor]:
    """Reference log-probs from HF transformers, one sequence at a time (no padding), fp32; `lora`: with
    that PEFT adapter on (the `peft` library's own forward)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    if lora is not None:
        try:
            import peft
        except ImportError:
            raise ImportError("a LoRA parity check compares against the peft library: pip install peft") from None
        model = peft.PeftModel.from_pretrained(model, lora).eval()
    out = []
    for seq in sequences:
        logits = model(seq.unsqueeze(0)).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, seq[1:, None]).squeeze(-1))
    return out


def token_weights(sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fixed signed per-token weights for a gradient check loss: `[T_i - 1]` each."""
    return [torch.tensor([(((b + 1) * (t + 3)) % 7 - 3) / 3.0 for t in range(len(s) - 1)])
            for b, s in enumerate(sequences)]


def layout_worker(layout_name: str, hf_dir: str, sequences: list[torch.Tensor], micro_batch_size: int = 2,
                  export_dir: str | None = None, grads: bool = False, recompute: bool = False,
                  pack_tokens: int | None = None, dtype: str = "fp32", lora: str | None = None) -> dict[str, Any]:
    """Runs on every rank: log-probs of this DP rank's share, optional HF export and gradients;
    `lora`: a PEFT adapter directory put on the model first (`policy/lora.py`).

    Returns {"rank", "dp_rank", "index", "logp", "grads" (HF name -> tensor, this rank's share)}.
    With `pack_tokens`, also the same computed on token-balanced DP shards packed into
    rows of that many tokens: "packed_index", "logp_packed", "grads_packed".
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from moe_rl.policy.convert import export_hf, load_hf_weights
    from moe_rl.policy.forward import compute_logprobs
    from moe_rl.policy.model import build_model, read_hf_config
    from moe_rl.policy.parallel import init_distributed

    layout = ParallelLayout.parse(layout_name)
    arch = read_hf_config(hf_dir)
    layout.validate(arch)
    init_distributed(layout)
    chunks = build_model(arch, layout, dtype, recompute=recompute)
    load_hf_weights(chunks, hf_dir, arch)
    if lora is not None:
        from moe_rl.policy.lora import attach_lora, read_peft, set_adapters

        spec, adapter = read_peft(lora, arch)
        attach_lora(chunks, arch, spec)
        set_adapters(chunks, arch, adapter)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    index = list(range(dp_rank, len(sequences), dp))
    mine = [sequences[i] for i in index]
    result: dict[str, Any] = {"rank": dist.get_rank(), "dp_rank": dp_rank, "index": index}
    result["logp"] = compute_logprobs(chunks, mine, micro_batch_size).logp
    if export_dir is not None:
        config = json.loads((Path(hf_dir) / "config.json").read_text())
        export_hf(chunks, export_dir, arch, config)
    if pack_tokens:
        from moe_rl.data.balance import balanced_shards

        packed = balanced_shards([len(s) for s in sequences], dp)[dp_rank]
        result["packed_index"] = packed
        result["logp_packed"] = compute_logprobs(chunks, [sequences[i] for i in packed], micro_batch_size,
                                                 max_tokens=pack_tokens).logp
    if grads:
        result["grads"], opt = _gradients(chunks, arch, sequences, index, micro_batch_size)
        if pack_tokens:
            result["grads_packed"], _ = _gradients(chunks, arch, sequences, result["packed_index"],
                                                   micro_batch_size, pack_tokens, opt)
    return result


def _gradients(chunks: list[Any], arch: Any, sequences: list[torch.Tensor], index: list[int],
               micro_batch_size: int, pack_tokens: int | None = None,
               opt: Any = None) -> tuple[dict[str, torch.Tensor], Any]:
    """Gradient of sum(w * logp) / N_global over the whole batch, this rank's HF-named share.

    `index`: this DP rank's sequences; `pack_tokens`: pack them into rows of that many
    tokens. The weights are left as they were.
    """
    from moe_rl.policy.forward import build_microbatches, microbatch_logprobs
    from moe_rl.policy.train_step import OptimConfig, PolicyOptimizer, frozen_rows

    weights = token_weights(sequences)
    total = sum(len(w) for w in weights)
    mine = [sequences[i] for i in index]
    w = torch.zeros(len(mine), max(len(s) for s in sequences) - 1)
    for j, i in enumerate(index):
        w[j, : len(weights[i])] = weights[i]
    mbs = build_microbatches(mine, micro_batch_size, pack_tokens, extras={"w": w},
                             seq_len=max(len(s) for s in sequences), chunks=chunks)

    def loss_fn(logits, mb):
        logp = microbatch_logprobs(logits, mb)
        valid = (mb.index >= 0).float().unsqueeze(1)
        loss = -(logp * mb.extras["w"] * mb.loss_mask * valid).sum() / total
        return loss, {}

    opt = opt or PolicyOptimizer(chunks, OptimConfig(), frozen_rows(arch))
    return hf_gradients(opt, arch, mbs, loss_fn), opt


def hf_gradients(opt: Any, arch: Any, microbatches: list[Any], loss_fn: Any) -> dict[str, torch.Tensor]:
    """This rank's HF-named share of the reduced gradient of `loss_fn` over `microbatches`
    (`PolicyOptimizer.backward`, no optimizer step); the weights are left as they were."""
    from moe_rl.policy.convert import iter_hf_tensors
    from moe_rl.policy.train_step import grads_as_params

    saved = [p.detach().clone() for c in opt.chunks for p in c.parameters()]
    opt.backward(microbatches, loss_fn)
    grads_as_params(opt.chunks)
    grads = {k: v.clone() for k, v in iter_hf_tensors(opt.bare_chunks, arch, buffers=False)}
    with torch.no_grad():
        for p, old in zip((p for c in opt.chunks for p in c.parameters()), saved):
            p.copy_(old)
    return grads


@dataclass
class ParityRow:
    """One layout's result, as printed and written to JSON."""

    layout: str
    world_size: int
    max_abs_diff: float
    mean_abs_diff: float
    seconds: float
    ok: bool
    error: str | None = None
    packed_max_abs_diff: float | None = None  # packed rows vs HF, when asked for


def compare(results: list[dict[str, Any]], reference: list[torch.Tensor], packed: bool = False) -> tuple[float, float]:
    """Max and mean |Δ log p| between per-rank results and the reference, over all tokens.

    `packed`: compare the packed-row results ("logp_packed") instead of the padded ones.
    """
    index, logp = ("packed_index", "logp_packed") if packed else ("index", "logp")
    diffs = []
    seen = set()
    for r in results:
        for j, i in enumerate(r[index]):
            if i in seen:
                continue
            seen.add(i)
            n = len(reference[i])
            diffs.append((r[logp][j, :n] - reference[i]).abs())
    if len(seen) != len(reference):
        raise RuntimeError(f"results cover {len(seen)} of {len(reference)} sequences")
    d = torch.cat(diffs)
    return float(d.max()), float(d.mean())


def check_layouts(hf_dir: str | Path, layouts: list[str], num_tokens: int = 24, num_sequences: int = 8,
                  tolerance: float = 1e-4, timeout: float = 600.0, progress: Any = None,
                  pack_tokens: int | None = None, lora: str | None = None) -> list[ParityRow]:
    """Run each layout on local processes and compare with HF transformers.

    `pack_tokens`: also score the sequences packed into rows of this many tokens; `lora`: with this
    PEFT adapter on both sides (HF through the peft library).
    """
    from moe_rl.dist.spawn import run_ranks

    arch = read_hf_config(hf_dir)
    sequences = sample_sequences(arch.vocab_size, num=num_sequences, max_len=num_tokens)
    reference = hf_logprobs(hf_dir, sequences, lora)
    rows = []
    for name in layouts:
        start = time.monotonic()
        try:
            layout = ParallelLayout.parse(name).validate(arch)
            results = run_ranks(layout_worker, layout.world_size, name, str(hf_dir), sequences, timeout=timeout,
                                pack_tokens=pack_tokens, lora=lora)
            mx, mean = compare(results, reference)
            packed = compare(results, reference, packed=True)[0] if pack_tokens else None
            ok = mx <= tolerance and (packed is None or packed <= tolerance)
            row = ParityRow(name, layout.world_size, mx, mean, time.monotonic() - start, ok,
                            packed_max_abs_diff=packed)
        except Exception as exc:  # a broken layout is a row in the table, not a crash
            world = _safe_world(name)
            row = ParityRow(name, world, float("nan"), float("nan"), time.monotonic() - start, False,
                            f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")
        rows.append(row)
        if progress:
            progress(row)
    return rows


def _safe_world(name: str) -> int:
    try:
        return ParallelLayout.parse(name).world_size
    except Exception:
        return 0


# ---------------------------------------------------------------- CLI

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf-model", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                   help="comma-separated layouts, each dash-joined tpN, ppN, vppN, epN, etpN, dpN; "
                        f"world size = product (vpp aside). Default: {DEFAULT_LAYOUTS}")
    p.add_argument("--tokens", type=int, default=24, help="longest sequence length to score (default 24)")
    p.add_argument("--sequences", type=int, default=8, help="number of sequences (default 8)")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max |Δ log p| allowed (default 1e-4, fp32)")
    p.add_argument("--pack-tokens", type=int, default=None,
                   help="also score the sequences packed several to a row of this many tokens (as with "
                        "parallel.max_tokens_per_microbatch), on token-balanced DP shards")
    p.add_argument("--lora", metavar="ADAPTER", default=None,
                   help="a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors, e.g. "
                        "`moe-rl export --peft`'s): compare with it on, against HF + the peft library")
    p.add_argument("--json", dest="json_out", help="also write the results as a JSON list to this file")


def _argument_problem(args: argparse.Namespace, layouts: list[str]) -> str | None:
    """One line saying what is wrong with the command line, or None."""
    if not (Path(args.hf_model) / "config.json").is_file():
        return f"--hf-model {args.hf_model}: no config.json there; give a HF checkpoint directory"
    try:
        read_hf_config(args.hf_model)  # a family or a setting megatron-core cannot reproduce: said before any rank
    except ValueError as e:
        return f"--hf-model {args.hf_model}: {e}"
    if args.lora is not None and not (Path(args.lora) / "adapter_config.json").is_file():
        return f"--lora {args.lora}: no adapter_config.json there; give a PEFT adapter directory"
    if not layouts:
        return "--layouts names no layout; give e.g. --layouts tp2,ep2"
    for name in layouts:
        try:
            ParallelLayout.parse(name)
        except LayoutError as e:
            return f"--layouts: {e}"
    if args.tokens < 2:
        return f"--tokens {args.tokens}: a sequence needs at least 2 tokens to score one"
    if args.sequences < 1:
        return f"--sequences {args.sequences}: must be >= 1"
    if not (math.isfinite(args.tolerance) and args.tolerance > 0):
        return f"--tolerance {args.tolerance:g}: must be a finite number > 0"
    return None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    problem = _argument_problem(args, layouts)
    if problem:  # plain print: rich would wrap the line at the terminal's width
        print(f"moe-rl check-parity: {problem}", file=sys.stderr)
        return 2
    console.print(f"checking {len(layouts)} layouts of {args.hf_model} against HF transformers "
                  f"(tolerance {args.tolerance:g})")

    def progress(row: ParityRow) -> None:
        mark = "[green]ok[/green]" if row.ok else "[red]FAIL[/red]"
        console.print(f"  {row.layout:<14} {mark}  max |Δ log p| {row.max_abs_diff:.2e}  ({row.seconds:.1f}s)"
                      + (f"  {row.error}" if row.error else ""))

    pack = args.pack_tokens
    if pack is not None and pack < args.tokens:
        print(f"moe-rl check-parity: --pack-tokens {pack} cannot hold a {args.tokens}-token sequence; use at "
              f"least {args.tokens}", file=sys.stderr)
        return 2
    rows = check_layouts(args.hf_model, layouts, args.tokens, args.sequences, args.tolerance, progress=progress,
                         pack_tokens=pack, lora=args.lora)
    table = Table(title="log-prob parity vs HF transformers")
    columns = ["layout", "ranks", "max |Δ log p|", "mean |Δ log p|"] + (["packed max |Δ log p|"] if pack else [])
    for col in columns + ["seconds", "ok"]:
        table.add_column(col)
    for r in rows:
        packed = [f"{r.packed_max_abs_diff:.2e}" if r.packed_max_abs_diff is not None else "-"] if pack else []
        table.add_row(r.layout, str(r.world_size), f"{r.max_abs_diff:.2e}", f"{r.mean_abs_diff:.2e}", *packed,
                      f"{r.seconds:.1f}", "yes" if r.ok else "NO")
    console.print(table)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0 if all(r.ok for r in rows) else 1
