"""An R3 run whose rollout engine returns corrupted routes on purpose: layers shifted by one (what
a server reading its routes at the wrong layer indices returns), or padding rows (routes left as
zeros). Each must stop the step loudly, naming the cause, before any update trains on them.

Lives in the package (not the test module) because spawned ranks import it by name.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np


def _shift_layers(routes: np.ndarray) -> np.ndarray:
    """The engine's MoE layer j holds layer j - 1's routes (the first keeps its own): valid rows."""
    out = routes.copy()
    out[:, 1:] = routes[:, :-1]
    return out


def _pad_response(routes: np.ndarray) -> np.ndarray:
    """The last rows (the response's) left as zeros, as an engine that pads its route buffer does."""
    out = routes.copy()
    out[-2:] = 0
    return out


CORRUPTIONS = {"shifted_layers": _shift_layers, "padding_rows": _pad_response}


def corrupt_routes_worker(cfg_dict: dict[str, Any], run_dir: str, corruptions: list[str]) -> list[dict[str, str]]:
    """For each corruption, one R3 step (a fresh first step: the layer check runs) with the engine's
    routes corrupted; returns the error each step raised (type and message), or "none"."""
    from moe_rl.config import RunConfig
    from moe_rl.recipes.build import build_run
    from moe_rl.recipes.rl.step import rl_step

    cfg = RunConfig.from_dict(cfg_dict)
    run = build_run(cfg, Path(run_dir), int(os.environ["RANK"]))["run"]
    engine, real_generate = run.engine, run.engine.generate
    out = []
    for step, name in enumerate(corruptions, start=1):
        def generate(requests: Any, corrupt: Any = CORRUPTIONS[name]) -> Any:
            # dataclasses.replace builds each result again: its own checks run on the corrupted rows
            return [[dataclasses.replace(r, routed_experts=corrupt(r.routed_experts)) for r in results]
                    for results in real_generate(requests)]

        engine.generate = generate
        run.drift_state.clear()  # each corruption meets a run's first R3 step
        try:
            rl_step(run, step)
            out.append({"corruption": name, "error": "none", "message": ""})
        except Exception as e:  # noqa: BLE001 - what the step raised is the result
            out.append({"corruption": name, "error": type(e).__name__, "message": str(e)})
    engine.close()
    return out
