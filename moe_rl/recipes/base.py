"""What the driver asks of a training method (`Recipe`), and what every method shares: the
policy's state, the data order, the weight version and the drift probe's state."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from moe_rl.config import RunConfig


class Recipe:
    """One training method over its `run` (the objects its step needs, built once).

    The driver calls, in order: `build`, `load_state_dict` (on resume) then `resumed`, per
    step `draws` / `step` / `evaluate` (when `eval_due`) / `state_dict` (at checkpoints),
    and at the end `close`, then `finish` (after a run that was not stopped early).
    """

    def __init__(self, run: Any, eval_set: Any = None) -> None:
        self.run = run
        self.eval_set = eval_set

    @classmethod
    def build(cls, cfg: RunConfig, out: Path, rank: int) -> Recipe:
        raise NotImplementedError

    @property
    def cfg(self) -> RunConfig:
        return self.run.cfg

    @property
    def rank(self) -> int:
        return self.run.rank

    def step(self, step: int) -> dict[str, float]:
        """One training step; its metrics (identical on every rank)."""
        raise NotImplementedError

    def eval_due(self, step: int) -> bool:
        every = self.cfg.train.eval_every
        return self.eval_set is not None and bool(every) and step % every == 0

    def evaluate(self, step: int) -> dict[str, float]:
        """Metrics on the held-out set (`eval/*`)."""
        raise NotImplementedError

    # ------------------------------------------------------------ checkpoints
    def models(self) -> dict[str, Any]:
        """The megatron models of the method by name (`policy`, and `critic` where there is one):
        a checkpoint saves each as a distributed checkpoint that any layout loads."""
        return {"policy": self.run.policy}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of this rank besides `models()` (the driver adds step and RNG)."""
        r = self.run
        return {"sampler": r.sampler.state_dict(), "weight_version": r.weight_version, "drift_state": r.drift_state}

    def load_state_dict(self, state: dict[str, Any], path: Path) -> None:
        r = self.run
        r.sampler.load_state_dict(state["sampler"])
        r.weight_version = state["weight_version"]
        r.drift_state = state["drift_state"]

    def resumed(self) -> None:
        """After `load_state_dict`: bring whatever lives outside this process up to date."""

    def draws(self) -> dict[str, Any]:
        """What a step changes before it can fail for want of a server (the data draws)."""
        return copy.deepcopy({"sampler": self.run.sampler.state_dict()})

    def undo_draws(self, before: dict[str, Any]) -> None:
        self.run.sampler.load_state_dict(before["sampler"])

    # ----------------------------------------------------------------- the end
    def close(self) -> None:
        """Release what the recipe started (servers, engines, update groups); runs on every exit."""

    def finish(self, out: Path) -> None:
        """After the last step (collective): the policy as a HF checkpoint with train.export_hf."""
        if self.cfg.train.export_hf:
            self.run.policy.export_hf(out / "hf")
