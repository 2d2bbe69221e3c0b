"""`make bench`: run every benchmark in tools/bench/ and write bench/RESULTS.md.

Each benchmark measures its variants side by side in one run and reports ratios,
so the tables stay meaningful on a shared, noisy machine. Sections run one after
another, each printing its start and its time; a section that fails is reported
in the file (and the exit status), and the others still run.

    python tools/bench/run_all.py            # everything (about 5 minutes on 2 idle cores)
    python tools/bench/run_all.py --quick    # small sizes, few rounds: a smoke test
    python tools/bench/run_all.py --only overhead scaling
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import async_rl
import ckpt_memory
import dpo_step
import experts
import critic
import handoff_bytes
import lora
import losses
import memory
import overhead
import replay
import route_intake
import rollout
import scaling
import step_options
import trl_parity
import weight_delta
import weight_sync
import weight_sync_cost

Section = tuple[str, str, Callable[[bool], str]]  # (key, title, run(quick) -> markdown)


def _packing(quick: bool) -> str:
    # Lands separately; called only when tools/bench/packing.py exists (see sections()).
    packing = importlib.import_module("packing")
    kwargs = _accepted(packing.bench_rows, quick=True, rounds=1, repeats=1, num=4, max_len=128) if quick else {}
    return packing.format_table(packing.bench_rows(**kwargs))


def _accepted(fn: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    """The subset of `kwargs` that `fn` takes by name."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def sections() -> list[Section]:
    out: list[Section] = [
        ("losses", "Losses: forward + backward vs a plain token-level PG loss",
         lambda q: losses.format_table(losses.bench_rows(batch=8, seq_len=256, repeats=2, warmup=1) if q
                                       else losses.bench_rows(repeats=5, warmup=2))),
        ("rollout", "Rollout engine: LocalEngine vs transformers generate()",
         lambda q: rollout.format_table(rollout.bench_rows(batch=2, new_tokens=8, repeats=1) if q
                                        else rollout.bench_rows())),
        ("replay", "Routing replay and drift measurement overhead",
         lambda q: replay.format_table(replay.bench_rows(rounds=1, batch=8, seq=32) if q
                                       else replay.bench_rows(rounds=3))),
        ("overhead", "Framework overhead: moe_rl update step vs bare megatron-core",
         lambda q: overhead.format_table(overhead.bench_rows(rounds=2, worlds=(1,)) if q
                                         else overhead.bench_rows())),
        ("experts", "Routed experts on CPU: megatron's per-expert loop vs GroupedExperts",
         lambda q: experts.format_table(experts.bench_rows(tokens=(256, 2304), rounds=2) if q
                                        else experts.bench_rows())),
        ("scaling", "Scaling of the update step: experts, sequence length, layout",
         lambda q: scaling.format_table(scaling.bench_rows(rounds=1, experts=(8, 16), seqs=(64, 128),
                                                           layouts=("ep2",)) if q
                                        else scaling.bench_rows())),
        ("weight_sync", "Weight sync time vs parameter count",
         lambda q: weight_sync.format_table(weight_sync.bench_rows(rounds=1, sizes=weight_sync.SIZES[:2]) if q
                                            else weight_sync.bench_rows())),
        ("weight_sync_scale", "Weight push at scale: every source vs the funnel through rank 0, full and delta, "
         "over layouts and expert counts", _weight_sync_scale),
        ("weight_delta", "What a step changes of the weights the servers hold (bf16), by learning rate, tensor kind "
         "and expert", lambda q: weight_delta.format_table(weight_delta.bench_rows(steps=2, lrs=(1e-6,)) if q
                                                           else weight_delta.bench_rows())),
        ("routes", "Stored routes per token vs log-probs",
         lambda q: memory.format_table(memory.bench_rows(shapes=memory.SHAPES[:2]) if q else memory.bench_rows())),
        ("step_options", "RL step cost of per-update volatility and rollout-correction masks",
         lambda q: step_options.format_table(step_options.bench_rows(rounds=1) if q else step_options.bench_rows())),
        ("critic", "A critic (PPO / VAPO) vs GRPO: RL step time and peak memory per rank",
         lambda q: critic.format_table(critic.bench_rows(rounds=1, batch=8, seq=64) if q else critic.bench_rows())),
        ("handoff", "Bytes per trainer rank per step: the step's samples and routes, before and now; who "
         "receives the replies (rollout.intake rank0 vs heads)",
         lambda q: (handoff_bytes.format_table(handoff_bytes.bench_rows(16, 256, 128), 16, 256, 128) if q
                    else handoff_bytes.format_table(handoff_bytes.bench_rows()))
         + "\n\n" + handoff_bytes.intake_table(handoff_bytes.intake_rows(q))),
        ("ckpt_memory", "Checkpoint host memory per rank with the distributed optimizer: megatron's gather vs each "
         "rank's own range", _ckpt_memory),
        ("route_intake", "R3's routes where they arrive: bytes, seconds and peak memory per SGLang reply and per "
         "step on the receiving process", lambda q: route_intake.format_table(route_intake.bench_rows(quick=q))),
    ]
    out.append(("lora", "LoRA vs full-parameter training: trainable parameters, optimizer bytes, update time, push "
                "bytes (same model, batch and layout)",
                lambda q: lora.format_table(lora.bench_rows(rounds=1, worlds=(1,)) if q else lora.bench_rows())))
    out.append(("dpo", "DPO step vs the RL update: tokens/s on the same tokens and layout",
                lambda q: dpo_step.format_table(dpo_step.bench_rows(rounds=2, worlds=(1,)) if q
                                                else dpo_step.bench_rows())))
    if (HERE / "packing.py").is_file():
        out.append(("packing", "Packing: packed vs padded tokens/s", _packing))
    out.append(("async", "Asynchronous RL: samples/s with algo.max_staleness K = 0, 1, 2, 4 (1 trainer + 1 server)",
                lambda q: async_rl.compare([0, 1] if q else [0, 1, 2, 4], 3 if q else 12, 1, 8) + "\n\n"
                + async_rl.compare([0, 2] if q else [0, 1, 2, 4], 3 if q else 12, 1, 8 if q else 32,
                                   task="toy:echo-tail")))
    out.append(("trl", "Time to reward against TRL's GRPOTrainer (same model, task, batch, GSPO; TRL optional)",
                lambda q: _trl("demo", q)))
    out.append(("trl_extended", "Generations to reward against TRL on many prompts, 2-token answers, 4 updates "
                "per generation, lr 1e-3 and 3e-3 (TRL optional)", lambda q: _trl("extended", q)))
    return out


def _ckpt_memory(quick: bool) -> str:
    rows = ckpt_memory.bench_rows(ckpt_memory.SIZES[:1] if quick else ckpt_memory.SIZES)
    return ckpt_memory.format_table(rows) + "\n\n" + ckpt_memory.flagship_table(rows)


def _weight_sync_scale(quick: bool) -> str:
    """The measured push (`weight_sync.py --scale`), then the cost model fitted to it and evaluated at the
    flagship layouts (`weight_sync_cost.py`)."""
    rows = (weight_sync.scale_rows(rounds=1, experts=(8,), layouts=weight_sync.SCALE_LAYOUTS[:2]) if quick
            else weight_sync.scale_rows())
    cost, f = weight_sync_cost.Assumptions(), 0.03
    flagships = [weight_sync_cost.flagship(weight_sync_cost.CONFIGS / n, cost, f) for n in weight_sync_cost.FLAGSHIPS]
    return "\n\n".join([weight_sync.format_scale(rows), "### The cost model at the flagship layouts (an estimate)",
                         weight_sync_cost.markdown(flagships, cost, f), weight_sync_cost.fit_report(rows, flagships, cost)])


def _trl(preset: str, quick: bool) -> str:
    """The TRL section for a preset of `trl_parity.PRESETS`: `fast`, `demo` and `async` over three seeds;
    the extended preset runs `fast` only here (the demo layout there: `trl_parity.py --preset extended`)."""
    from dataclasses import replace

    settings = trl_parity.PRESETS[preset]
    if quick:
        return trl_parity.compare([replace(settings[0], max_generations=2)], ["fast"], seeds=trl_parity.SEEDS[:1])
    return trl_parity.compare(settings, ["fast", "demo", "async"] if preset == "demo" else ["fast"])


def _versions() -> str:
    try:
        from importlib.metadata import version

        return f"torch {torch.__version__}, megatron-core {version('megatron-core')}"
    except Exception:  # noqa: BLE001 - a header detail, never worth failing the run
        return f"torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    all_keys = [key for key, _, _ in sections()]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes and few rounds (a smoke test)")
    p.add_argument("--only", nargs="+", choices=all_keys, default=all_keys, help="run only these sections")
    p.add_argument("--out", default="bench/RESULTS.md")
    a = p.parse_args(argv)

    start = time.monotonic()
    load = os.getloadavg()[0]
    parts, failed = [], []
    for key, title, run in sections():
        if key not in a.only:
            continue
        t0 = time.monotonic()
        print(f"[{t0 - start:5.0f} s] {title} ...", flush=True)
        try:
            body = run(a.quick)
        except Exception:  # noqa: BLE001 - record it and go on with the other sections
            failed.append(key)
            body = "**failed:**\n\n```\n" + traceback.format_exc()[-3000:] + "```"
            print(traceback.format_exc(), file=sys.stderr, flush=True)
        took = time.monotonic() - t0
        print(f"[{time.monotonic() - start:5.0f} s] {title}: {'FAILED' if key in failed else 'done'} "
              f"in {took:.0f} s", flush=True)
        parts.append(f"\n## {title}\n\n_{took:.0f} s_\n\n{body}\n")
    total = time.monotonic() - start
    header = (f"# Benchmarks{' (--quick)' if a.quick else ''}\n\n"
              f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} torch "
              f"threads, {_versions()}; total {total:.0f} s; load average {load:.1f} at the start, "
              f"{os.getloadavg()[0]:.1f} at the end (other work on the machine slows wall times).\n")
    text = header + "".join(parts)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"written to {out} in {total:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
