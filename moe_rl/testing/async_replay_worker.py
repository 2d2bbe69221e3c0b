"""R3 across weight versions, through the trainer: an asynchronous run whose pushes land while
samples generate, checked token by token against HF forwards of each version's weights.

Lives in the package (not the test module) because spawned ranks import it by name.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch


def _hf_routes(model: torch.nn.Module, state: dict[str, torch.Tensor], sequence: torch.Tensor) -> torch.Tensor:
    """Top-k experts of every position but the last, `[T - 1, L, K]`, under the weights `state`."""
    from moe_rl.drift.routes import hf_routes

    model.load_state_dict(state)
    with torch.no_grad():
        return hf_routes(model, sequence.view(1, -1))[0, :-1].long()


def async_replay_worker(cfg_dict: dict[str, Any], run_dir: str, steps: int) -> dict[str, Any]:
    """`steps` RL steps of an asynchronous R3 run with the engine in this process; per trained
    sample, which versions generated its tokens and how many replayed routes equal the routes an
    HF forward of the version that computed them chooses.

    `rollout.inflight_update=retract`: every position is computed again under the weights of the
    push that retracted it, so all of a sample's routes are its last version's. `in_place`: the
    positions computed before the first push are the first version's; the later ones attend to
    keys and values of the older weights, which no single version's forward reproduces (counted
    apart, not compared)."""
    from moe_rl.config import RunConfig
    from moe_rl.recipes.build import build_run
    from moe_rl.recipes.rl import step as loop

    cfg = RunConfig.from_dict(cfg_dict)
    built = build_run(cfg, Path(run_dir), int(os.environ["RANK"]))
    run = built["run"]
    engine = run.engine
    weights = {0: copy.deepcopy(engine.model.state_dict())}  # what the engine holds per weight version
    real_push, real_old, real_update = engine.update_weights_from_tensors, loop.old_logprobs, run.policy.update
    trained: list[tuple[Any, list[torch.Tensor], torch.Tensor]] = []  # (samples, sequences, replayed routes)
    current: dict[str, Any] = {}

    def push(named_tensors: Any, version: Any = None) -> None:
        real_push(named_tensors, version)
        weights[int(version)] = copy.deepcopy(engine.model.state_dict())

    def old_logprobs(run_: Any, mine: Any, step: int, first: Any = None) -> Any:
        current["samples"] = mine
        return real_old(run_, mine, step, first)

    def update(sequences: Any, extras: Any, loss: Any, replay_routes: Any = None) -> Any:
        trained.append((current["samples"], list(sequences), replay_routes))
        return real_update(sequences, extras, loss, replay_routes=replay_routes)

    engine.update_weights_from_tensors, loop.old_logprobs, run.policy.update = push, old_logprobs, update
    metrics = []
    try:
        for step in range(1, steps + 1):
            metrics.append(loop.rl_step(run, step))
    finally:
        loop.old_logprobs = real_old
        run.rollouts.close()
        engine.close()
    model = copy.deepcopy(engine.model).eval()
    retract = cfg.rollout.inflight_update == "retract"
    rows = []
    for samples, sequences, replayed in trained:
        by_tokens = {tuple(s.tolist()): i for i, s in enumerate(samples.sequences)}
        for row, seq in enumerate(sequences):
            i = by_tokens[tuple(seq.tolist())]
            versions = samples.versions[i].tolist()
            prompt_len, n = int(samples.prompt_lens[i]), len(seq) - 1
            got = replayed[row, :n].long()
            # retract: one version computed every position, the last one; in place: the prompt and
            # the tokens of the first version were computed before any push
            computed, other = (versions[-1], versions[0]) if retract else (versions[0], versions[-1])
            checked = n if retract else prompt_len - 1 + versions.count(versions[0])
            want = _hf_routes(model, weights[computed], seq)[:checked]
            rows.append({"versions": sorted(set(versions)), "positions": n, "checked": checked,
                         "equal": int((got[:checked] == want).all(-1).all(-1).sum()),
                         # the other version routes some compared position elsewhere: the check tells them apart
                         "versions_differ": bool((_hf_routes(model, weights[other], seq)[:checked] != want).any()),
                         "replayed_is_engine": bool(torch.equal(got, samples.routes[i].long()))})
    return {"rows": rows, "metrics": metrics}
