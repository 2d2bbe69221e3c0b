"""Step-time cost of the RL step's stability options, as ratios measured side by side.

Whole RL steps (`moe_rl.recipes.rl.step.rl_step`: rollout from `moe-rl serve`, rewards, old pass,
updates, weight sync, drift) on the demo config, one run for all variants: each round
runs one step of every variant, in an order rotated from round to round, switching only
the config, so machine noise and the policy's progress hit them alike. Both options act
inside the updates phase (`perf/updates_s`), which is compared; the whole step is shown
too (its rollout varies with what the policy samples).

- default:      the demo config (drift on the step's tokens and the probe set)
- per_update:   + `drift.per_update=true` (a probe forward after every optimizer update)
- tis:          + `algo.tis_cap=2`
- icepop:       + `algo.rollout_correction.mode=icepop`
- seq_mask:     + `algo.rollout_correction.mode=seq_mask`

    python tools/bench/step_options.py [--rounds 4] [--world 1]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

CONFIG = "launch/configs/tiny_cpu.yaml"


def _variants(cfg: Any) -> dict[str, Any]:
    algo, drift = cfg.algo, cfg.drift
    correction = lambda mode: dataclasses.replace(  # noqa: E731
        cfg, algo=dataclasses.replace(algo, rollout_correction=dataclasses.replace(algo.rollout_correction, mode=mode)))
    return {"default": cfg,
            "per_update": dataclasses.replace(cfg, drift=dataclasses.replace(drift, per_update=True)),
            "tis": dataclasses.replace(cfg, algo=dataclasses.replace(algo, tis_cap=2.0)),
            "icepop": correction("icepop"),
            "seq_mask": correction("seq_mask")}


def _worker(cfg_dict: dict[str, Any], run_dir: str, rounds: int) -> dict[str, dict[str, list[float]]]:
    from moe_rl.config import RunConfig
    from moe_rl.recipes.build import build_run
    from moe_rl.recipes.rl.step import rl_step

    cfg = RunConfig.from_dict(cfg_dict)
    built = build_run(cfg, Path(run_dir), int(os.environ["RANK"]))
    run, servers = built["run"], built["servers"]
    variants = list(_variants(cfg).items())
    times: dict[str, dict[str, list[float]]] = {k: {"step": [], "updates": []} for k, _ in variants}
    step = 0
    try:
        for r in range(rounds + 1):  # round 0 warms every variant up
            for name, variant in variants[r % len(variants):] + variants[:r % len(variants)]:
                run.cfg = variant
                step += 1
                m = rl_step(run, step)
                if r:
                    times[name]["step"].append(m["perf/step_s"])
                    times[name]["updates"].append(m.get("perf/updates_s", float("nan")))
    finally:
        if run.engine is not None:
            run.engine.close()
        if servers is not None:
            servers.stop()
    return times


def bench_rows(rounds: int = 4, world: int = 1) -> list[dict[str, Any]]:
    from moe_rl.config import load_config
    from moe_rl.testing import free_ports, run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(CONFIG, [f"train.world_size={world}", f"parallel.ep={world}", f"log.run_dir={tmp}",
                                   f"rollout.base_port={free_ports(1)}", "log.tensorboard=false",
                                   "drift.every=1", "drift.probe_every=1"])  # drift in every step, as before
        times = run_ranks(_worker, world, cfg.to_dict(), tmp, rounds, timeout=1800)[0]
    base = statistics.median(times["default"]["updates"])
    return [{"variant": k, "updates_s": statistics.median(v["updates"]), "step_s": statistics.median(v["step"]),
             "ratio": statistics.median(v["updates"]) / base} for k, v in times.items()]


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | median updates phase (s) | × default | median whole step (s) |", "|---|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['updates_s']:.3f} | {r['ratio']:.3f} | {r['step_s']:.3f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--world", type=int, default=1, help="trainer ranks (EP over them when > 1)")
    a = p.parse_args(argv)
    table = format_table(bench_rows(a.rounds, a.world))
    print(table)
    return table


if __name__ == "__main__":
    main()
