"""Rollout throughput: LocalEngine against transformers' own `generate()` on the same model.

Both sample B prompts of P tokens and exactly N new tokens each (LocalEngine with
ignore_eos, `generate()` with min_new_tokens = max_new_tokens), temperature 1,
no top-k / top-p. LocalEngine also returns per-token log-probs and routed experts;
plain `generate()` returns tokens only. The two are timed in turns within each
repeat (not one after the other), and the table reports medians.

    python tools/bench/rollout.py                       # tiny Qwen3-MoE, B=8, P=32, N=64
    python tools/bench/rollout.py --threads 1           # steadier on a shared machine
    python tools/bench/rollout.py --model DIR --batch 16 --new-tokens 128
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moe_rl.rollout.engine import GenerateRequest, SamplingParams
from moe_rl.rollout.local_engine import LocalEngine


def _hf_generate(model, prompts: torch.Tensor, new_tokens: int, pad: int) -> torch.Tensor:
    return model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                          temperature=1.0, top_k=None, top_p=None, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, pad_token_id=pad)


def bench_rows(model_dir: str | Path | None = None, batch: int = 8, prompt_len: int = 32, new_tokens: int = 64,
               repeats: int = 5, warmup: int = 1, seed: int = 0) -> list[dict]:
    """Median wall time and tokens/s of each engine; ratio to transformers' generate().

    Returns rows ``{"engine", "s", "tokens_per_s", "ratio", "batch", "prompt_len", "new_tokens",
    "threads"}``, the transformers baseline first.
    """
    from transformers import AutoModelForCausalLM

    tmp = None
    if model_dir is None:
        from moe_rl.testing import make_tiny_qwen3_moe

        tmp = tempfile.TemporaryDirectory()
        model_dir = make_tiny_qwen3_moe(Path(tmp.name) / "tiny", seed=seed)
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        engine = LocalEngine(model_dir, seed=seed, max_batch=batch)
        g = torch.Generator().manual_seed(seed)
        vocab = hf.config.vocab_size
        prompts = torch.randint(3, vocab, (batch, prompt_len), generator=g)
        reqs = [GenerateRequest(p.tolist(), SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
                for p in prompts]
        pad = int(getattr(hf.config, "pad_token_id", None) or 0)

        def run_hf() -> int:
            with torch.no_grad():
                out = _hf_generate(hf, prompts, new_tokens, pad)
            return int(out.shape[1] - prompt_len) * batch

        def run_local() -> int:
            res = engine.generate(reqs)
            assert all(r[0].routed_experts is not None for r in res)
            return sum(len(r[0].output_ids) for r in res)

        cases = {"transformers generate()": run_hf,
                 "LocalEngine (+ log-probs, routes)": run_local}
        times: dict[str, list[float]] = {k: [] for k in cases}
        tokens: dict[str, int] = {}
        for rep in range(warmup + repeats):
            for name, fn in cases.items():  # in turns: both see the same machine state
                t0 = time.perf_counter()
                tokens[name] = fn()
                dt = time.perf_counter() - t0
                if rep >= warmup:
                    times[name].append(dt)
        engine.close()
    finally:
        if tmp is not None:
            tmp.cleanup()
    base = statistics.median(times["transformers generate()"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"engine": name, "s": med, "tokens_per_s": tokens[name] / med, "ratio": base / med,
                     "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
                     "threads": torch.get_num_threads()})
    return rows


def format_table(rows: list[dict]) -> str:
    """Markdown table of `bench_rows` output."""
    r0 = rows[0]
    head = (f"rollout, B={r0['batch']}, prompt {r0['prompt_len']}, {r0['new_tokens']} new tokens, "
            f"cpu ({r0['threads']} threads), median of repeats")
    lines = [head, "", "| engine | s | new tokens/s | speed × generate() |", "|---|---:|---:|---:|"]
    lines += [f"| {r['engine']} | {r['s']:.3f} | {r['tokens_per_s']:.0f} | {r['ratio']:.2f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: a tiny Qwen3-MoE built on the fly)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice); 1 is steadiest on a busy machine")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = bench_rows(args.model, args.batch, args.prompt_len, args.new_tokens, args.repeats, args.warmup)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
