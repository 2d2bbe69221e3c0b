"""Where one RL step's time goes: phases (`perf/*_s`) and the costliest calls, per rank.

Builds the run of a config exactly as `moe-rl train` does (`trainer.build_run`: policy,
rollout server, weight sync) on `train.world_size` local gloo ranks, takes `--warmup`
steps, then profiles `--steps` steps with cProfile on every rank. It prints each phase's
seconds per step and, per rank, the calls with the most cumulative time that are not
just wrappers of another listed call's time (the "top costs"), and the functions with
the most time of their own (where the interpreter actually spends it).

    python tools/bench/profile_step.py                                   # the demo config
    python tools/bench/profile_step.py --config launch/configs/tiny_cpu.yaml drift.enabled=false
    python tools/bench/profile_step.py --like extended:fast              # a run of the TRL section

`--like PRESET:VARIANT` profiles the run of `trl_parity.py`'s preset (its first setting) and
moe_rl variant: that section's overrides come first, then the command line's.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "launch" / "configs" / "tiny_cpu.yaml"
# Calls that only wrap the step (their cumulative time is the whole step): not interesting.
_WRAPPERS = ("rl_step", "_lsprof", "profile_rank", "<built-in method builtins.exec>")


def profile_rank(cfg_dict: dict[str, Any], out: str, warmup: int, steps: int, top: int) -> dict[str, Any]:
    """One rank: build the run, take `warmup` steps, then profile `steps` steps.

    Returns the mean phase seconds per profiled step and two top-`top` tables (text).
    """
    import torch.distributed as dist

    from common import trainer_run
    from moe_rl.recipes.rl.step import rl_step

    with trainer_run(cfg_dict, out) as run:
        for step in range(1, warmup + 1):
            rl_step(run, step)
        prof = cProfile.Profile()
        phases: dict[str, float] = {}
        for step in range(warmup + 1, warmup + steps + 1):
            prof.enable()
            metrics = rl_step(run, step)
            prof.disable()
            for k, v in metrics.items():
                if k.startswith("perf/") and k.endswith("_s"):
                    phases[k] = phases.get(k, 0.0) + v / steps
    return {"rank": dist.get_rank(), "phases": phases, "cumulative": _table(prof, "cumulative", top, steps),
            "own": _table(prof, "tottime", top, steps)}


def _table(prof: cProfile.Profile, key: str, top: int, steps: int) -> list[tuple[str, int, float, float]]:
    """(function, calls per step, own s per step, cumulative s per step), the `top` largest by `key`."""
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, name), (_cc, calls, own, cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        label = name if file == "~" else f"{Path(file).parent.name}/{Path(file).name}:{line}:{name}"
        if any(w in label for w in _WRAPPERS):
            continue
        rows.append((label, calls // steps, own / steps, cum / steps))
    rows.sort(key=lambda r: r[3] if key == "cumulative" else r[2], reverse=True)
    return rows[:top]


def format_report(results: list[dict[str, Any]], top: int) -> str:
    from common import md_table

    first = results[0]
    lines = ["Phases, seconds per step (rank 0; `perf/step_s` is the whole step):", "",
             md_table(["phase", "s"], [(k, f"{v:.3f}") for k, v in sorted(first["phases"].items(),
                                                                        key=lambda kv: -kv[1])]), ""]
    for r in results:
        for key, title in (("cumulative", "cumulative time (call and its callees)"), ("own", "own time")):
            lines += [f"Rank {r['rank']}: top {top} calls by {title}, per step:", "",
                      md_table(["call", "calls", "own s", "cum s"],
                               [(f"`{n}`", c, f"{o:.4f}", f"{cu:.4f}") for n, c, o, cu in r[key]]), ""]
    return "\n".join(lines)


def run(config: str = str(DEMO), overrides: list[str] | None = None, warmup: int = 2, steps: int = 3,
        top: int = 25) -> str:
    from moe_rl.config import load_config
    from moe_rl.dist.spawn import run_ranks

    quiet = ["log.progress=false", "log.tensorboard=false", "train.eval_every=0", "train.save_every=0"]
    cfg = load_config(config, quiet + list(overrides or []))
    with tempfile.TemporaryDirectory() as out:
        results = run_ranks(profile_rank, cfg.train.world_size, cfg.to_dict(), out, warmup, steps, top,
                            timeout=900)
    return format_report(sorted(results, key=lambda r: r["rank"]), top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEMO))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--like", metavar="PRESET:VARIANT", help="the run of a trl_parity.py preset and variant")
    p.add_argument("overrides", nargs="*", help="dotlist overrides, as for `moe-rl train`")
    a = p.parse_args()
    print(run(a.config, like(a.like) + a.overrides, a.warmup, a.steps, a.top))


def like(spec: str | None) -> list[str]:
    """The overrides of `trl_parity.py`'s run `PRESET:VARIANT` (seed 1234), or none."""
    if not spec:
        return []
    import trl_parity

    preset, _, variant = spec.partition(":")
    return trl_parity.common(trl_parity.PRESETS[preset][0], trl_parity.SEEDS[0]) + \
        trl_parity.VARIANTS[variant or "fast"][1]


if __name__ == "__main__":
    main()
