"""Progress display for long runs: a live view in a terminal, one line per step elsewhere.

    progress = Progress(cfg.train.steps, enabled=rank == 0, live=None if cfg.log.progress else False)
    with progress:
        for step in range(start + 1, cfg.train.steps + 1):
            progress.status("rollout")
            ...
            progress.update(step, metrics)

In a terminal the live view shows a bar with step/total, the key numbers of
the last step (reward mean, success rate, volatility, tokens/s, step time; for
DPO the loss and reward accuracy), the ETA and the current phase. Without a
terminal (CI, SLURM output files) each `update` prints exactly one line, e.g.

    step 12/200 | reward 0.531 | success 41.0% | vol 0.084 | 1,234 tok/s | 12.3 s/step | ETA 0:38:32
    step 12/200 | loss 0.627 | acc 66.7% | 4,536 tok/s | 0.1 s/step | ETA 0:00:17          (DPO)

and `status` prints nothing, so logs get one line per step, never more.
Lines are printed to stdout directly rather than through `logging`, so the
run's heartbeat is visible even when the log level is "warning".
"""
from __future__ import annotations

import math
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Mapping, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from moe_rl.observe.logging import get_console

__all__ = ["Progress", "format_step_line"]

# (metric key, label, formatter) in display order; missing keys are left out.
_FIELDS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("reward/mean", "reward", lambda v: f"{v:.3f}"),
    ("reward/success_rate", "success", lambda v: f"{100 * v:.1f}%"),
    ("eval/success_rate", "eval", lambda v: f"{100 * v:.1f}%"),
    ("loss/dpo", "loss", lambda v: f"{v:.3f}"),  # DPO: the loss and the share of pairs ranked right
    ("dpo/reward_accuracy", "acc", lambda v: f"{100 * v:.1f}%"),
    ("eval/reward_accuracy", "eval acc", lambda v: f"{100 * v:.1f}%"),
    ("drift/volatility", "vol", lambda v: f"{v:.3f}"),
    ("perf/tokens_per_s", "", lambda v: f"{v:,.0f} tok/s"),
    ("perf/step_s", "", lambda v: f"{v:.1f} s/step"),
)


def format_step_line(step: int, total: int, metrics: Mapping[str, Any], eta_s: float | None) -> str:
    """One line with step/total, the key metrics present in `metrics`, and the ETA."""
    parts = [f"step {step}/{total}"]
    for key, label, fmt in _FIELDS:
        value = metrics.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            text = fmt(float(value)) if math.isfinite(value) else str(value)
            parts.append(f"{label} {text}" if label else text)
    if eta_s is not None:
        parts.append(f"ETA {_format_duration(eta_s)}")
    return " | ".join(parts)


def _format_duration(seconds: float) -> str:
    return str(timedelta(seconds=int(round(max(seconds, 0.0)))))


class Progress:
    """Step progress for a run of `total_steps` steps.

    enabled: False makes every call a no-op (ranks other than 0).
    live: True forces the live view, False forces plain lines, None (default)
        picks the live view when stdout is a terminal.
    `update(step, metrics)` takes the step just finished, counting from 1, so
    the last step is `total_steps`.
    """

    def __init__(self, total_steps: int, enabled: bool = True, *, live: bool | None = None,
                 console: Console | None = None, file: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total_steps = int(total_steps)
        self.enabled = enabled
        self._console = console or get_console()
        self._file = file  # plain-line output; None = sys.stdout at write time (so capture works)
        self._clock = clock
        self._status = ""
        self._line = ""
        self._step = 0
        self._first: tuple[int, float] | None = None  # (step, time) of the first update
        self._eta: float | None = None
        use_live = self._console.is_terminal if live is None else live
        self._live = Live(get_renderable=self._render, console=self._console,
                          refresh_per_second=2, transient=False) if enabled and use_live else None
        self._started = False

    @property
    def live(self) -> bool:
        """Whether the live (terminal) view is used rather than plain lines."""
        return self._live is not None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def status(self, text: str) -> None:
        """Show the current phase (e.g. "rollout", "train", "sync") in the live view."""
        if not self.enabled:
            return
        self._status = text
        self._ensure_started()

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record that `step` finished with `metrics`; prints a line in plain mode."""
        if not self.enabled:
            return
        self._step = int(step)
        self._eta = self._estimate_eta(self._step, metrics)
        self._line = format_step_line(self._step, self.total_steps, metrics, self._eta)
        if self._live is None:
            out = self._file or sys.stdout
            out.write(self._line + "\n")
            out.flush()
        else:
            self._ensure_started()
            self._live.refresh()

    def close(self) -> None:
        """Stop the live view (its last state stays on screen)."""
        if self._live is not None and self._started:
            self._live.stop()
            self._started = False

    def _ensure_started(self) -> None:
        if self._live is not None and not self._started:
            self._live.start()
            self._started = True

    def _estimate_eta(self, step: int, metrics: Mapping[str, Any]) -> float | None:
        """Seconds left: mean wall time per step since the first update seen.

        Measured from the first update, not from construction, so that setup
        time and the steps before a resume do not skew it. Until two updates
        exist, the step's own `perf/step_s` is the best guess.
        """
        now = self._clock()
        remaining = max(self.total_steps - step, 0)
        if self._first is None:
            self._first = (step, now)
        first_step, first_time = self._first
        if step > first_step:
            return remaining * (now - first_time) / (step - first_step)
        step_s = metrics.get("perf/step_s")
        if isinstance(step_s, (int, float)) and math.isfinite(step_s):
            return remaining * float(step_s)
        return None

    def _render(self) -> Group:
        """Bar, percentage and phase on one row; the step line (numbers and ETA) below."""
        done = self._step / max(self.total_steps, 1)
        row = Table.grid(padding=(0, 1))
        row.add_row(ProgressBar(total=max(self.total_steps, 1), completed=self._step, width=40),
                    Text(f"{100 * done:3.0f}%"),
                    Text(f"[{self._status}]" if self._status else "", style="cyan"))
        line = Text(self._line) if self._line else Text("waiting for the first step", style="dim")
        return Group(row, line)
