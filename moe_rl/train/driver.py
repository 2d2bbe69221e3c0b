"""`moe-rl train`: the driver. It builds the recipe of `train.mode` (moe_rl/recipes/: RL or
DPO) and runs it the same way whatever it is: resume, steps, evaluation, metric sinks,
checkpoints, stop signals, report.

Single machine: `train.world_size` trainer processes are spawned here (gloo on CPU,
nccl on GPU). Under torchrun or srun (RANK / SLURM_PROCID set) this process is one
rank of the job and nothing is spawned.

The run directory (printed at start): config.yaml, metrics.jsonl, tb/, train.log,
checkpoints/, weights/ (versions synced to the engine), servers/ (engine logs), report/.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from moe_rl.algo.config import staleness_bound
from moe_rl.config import ConfigError, RunConfig, load_config, named_run_dir
from moe_rl.dist.collectives import agree
from moe_rl.dist.ports import free_port
from moe_rl.dist.spawn import set_local_rank_env
from moe_rl.drift.alarm import EXIT_DRIFT_ALARM, Alarms, DriftAlarm
from moe_rl.recipes import build_recipe
from moe_rl.recipes.build import cpu_threads_of
from moe_rl.rollout.outage import EXIT_NO_SERVER, RolloutLost
from moe_rl.train.checkpoint import Checkpoints, latest_checkpoint, resume


# ---------------------------------------------------------------- CLI

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="run config YAML (see launch/configs/)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="config overrides, e.g. algo.loss=sapo train.steps=40")
    p.epilog = ("Config keys: `moe-rl config` lists every key with its type, default, allowed values and doc "
                "(`moe-rl config algo`, `moe-rl config algo.max_staleness`); the same reference is docs/reference/config.md.")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        named = named_run_dir(args.config, args.overrides)
        return _refuse(str(e), Path(named) if named else None)
    run_dir = resolve_run_dir(cfg)
    launched = "RANK" in os.environ or "SLURM_PROCID" in os.environ
    problem = _preflight(cfg, launched)
    if problem:  # a run directory that exists or was named gets it too
        return _refuse(problem, run_dir if run_dir.is_dir() or cfg.log.run_dir else None)
    if launched:
        return train_rank(cfg, str(run_dir))
    print(f"run directory: {run_dir}", flush=True)
    if cfg.train.world_size == 1:
        return _single(cfg, str(run_dir))
    return spawn(cfg, str(run_dir))


def _refuse(problem: str, run_dir: Path | None) -> int:
    """A config or preflight refusal: one message on stderr, and in `run_dir/train.log` when there
    is one (the place a batch job's user looks); exit status 2."""
    print(f"moe-rl train: {problem}", file=sys.stderr)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "train.log", "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR moe_rl: {problem}\n")
    return 2


def _preflight(cfg: RunConfig, launched: bool) -> str | None:
    """`moe_rl.train.preflight` for the world this run will have (the launcher's, or train.world_size)."""
    from moe_rl.policy.parallel import read_dist_env
    from moe_rl.train.preflight import preflight

    return preflight(cfg, read_dist_env().world_size if launched else cfg.train.world_size)


def resolve_run_dir(cfg: RunConfig) -> Path:
    """`log.run_dir`, or a resumed run's directory, or `runs/<name>-<timestamp>`."""
    if cfg.log.run_dir:
        return Path(cfg.log.run_dir)
    if cfg.train.resume and cfg.train.resume != "auto":
        return Path(cfg.train.resume).resolve().parents[1]
    return Path("runs") / f"{cfg.log.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _single(cfg: RunConfig, run_dir: str) -> int:
    set_local_rank_env(0, 1, free_port())
    return train_rank(cfg, run_dir)


def spawn(cfg: RunConfig, run_dir: str) -> int:
    """Start `train.world_size` local ranks; a rank's failure ends the run with its traceback."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.start_processes(_spawned, args=(cfg.to_dict(), run_dir, cfg.train.world_size, port),
                             nprocs=cfg.train.world_size, join=False, start_method="spawn")

    def forward(signum: int, _frame: Any) -> None:
        # Preemption: the ranks checkpoint and exit 0; this process waits for them.
        for pid in ctx.pids():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    interrupts = []

    def interrupt(_signum: int, frame: Any) -> None:
        # Ctrl-C reaches the ranks too (one process group); they ignore SIGINT and act on what
        # this process sends: the first asks for a checkpoint at the end of the step (SIGTERM),
        # the second stops them at once (SIGUSR2).
        interrupts.append(1)
        first = len(interrupts) == 1
        print("\nmoe-rl train: " + ("Ctrl-C: checkpoint at the end of this step, then exit (Ctrl-C again to "
                                   "stop at once)" if first else "second Ctrl-C: stopping now"), file=sys.stderr)
        forward(signal.SIGTERM if first else signal.SIGUSR2, frame)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, forward)
    signal.signal(signal.SIGINT, interrupt)
    try:
        while not ctx.join():
            pass
    except mp.ProcessRaisedException as e:
        print(f"moe-rl train failed:\n{e}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        if len(interrupts) > 1:  # stopped at once, as asked: a rank may die of SIGUSR2 while it exits
            return 130
        print(f"moe-rl train: a rank exited with code {e.exit_code}", file=sys.stderr)
        return e.exit_code or 1
    return 0


def _spawned(rank: int, cfg_dict: dict[str, Any], run_dir: str, world: int, port: int) -> None:
    set_local_rank_env(rank, world, port)
    cfg = RunConfig.from_dict(cfg_dict)
    torch.set_num_threads(cpu_threads_of(cfg)[0])  # the ranks (and servers that run at once) share the cores
    code = train_rank(cfg, run_dir, spawned=True)
    # Python restores SIGUSR2's default (death) while it shuts down: a second Ctrl-C that lands
    # then would end a rank that finished cleanly with -12; nothing is left to stop.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    if code:
        sys.exit(code)


# ---------------------------------------------------------------- one rank

class _Stop:
    """Set by SIGTERM / SIGUSR1 (SLURM preemption) or a first Ctrl-C: checkpoint at the next step
    boundary and exit 0. A second Ctrl-C (or SIGUSR2, what `spawn` sends for it) stops at once."""

    requested = False

    @classmethod
    def install(cls, spawned: bool) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, lambda *_: setattr(cls, "requested", True))
        signal.signal(signal.SIGUSR2, cls._now)
        # spawned ranks leave Ctrl-C to the parent, which sends SIGTERM, then SIGUSR2
        signal.signal(signal.SIGINT, signal.SIG_IGN if spawned else cls._interrupt)

    @classmethod
    def _interrupt(cls, *_: Any) -> None:
        if cls.requested:
            cls._now()
        cls.requested = True
        print("\nmoe-rl train: Ctrl-C: checkpoint at the end of this step, then exit (Ctrl-C again to stop at "
              "once)", file=sys.stderr)

    @staticmethod
    def _now(*_: Any) -> None:
        raise KeyboardInterrupt("stopped at once: no checkpoint of the current step")


def train_rank(cfg: RunConfig, run_dir: str, spawned: bool = False) -> int:
    """Everything one trainer rank does, start to end (`spawned`: a child of `spawn`, which
    handles Ctrl-C for it)."""
    from moe_rl.observe.logging import setup_logging
    from moe_rl.observe.progress import Progress
    from moe_rl.observe.report import build_report
    from moe_rl.observe.sinks import make_sinks

    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = setup_logging(cfg.log.level, rank, cfg.log.all_ranks, out / "train.log")
    if rank == 0:
        (out / "config.yaml").write_text(cfg.to_yaml())  # the resolved config, overrides applied
    _Stop.install(spawned)
    if cfg.train.device_guard:  # CPU rehearsal: a host tensor in a collective fails here, not on a GPU
        from moe_rl.dist.device_guard import install_device_guard

        install_device_guard()
    recipe = build_recipe(cfg, out, rank)  # train.mode: RL or DPO (moe_rl/recipes/)
    sinks = make_sinks(cfg.log, out, cfg.to_dict(), rank)
    start_step = resume(recipe, cfg, out, log) + 1
    if start_step > 1:
        recipe.resumed()
    progress = Progress(cfg.train.steps, enabled=rank == 0, live=None if cfg.log.progress else False)
    ckpt = Checkpoints(recipe, out, cfg.train.keep_last, cfg.train.async_save)
    # drift.alarm: thresholds on each step's metrics, whatever the recipe; the collapse alarm on by default when async
    alarms = Alarms(cfg.drift.alarm, rank, asynchronous=staleness_bound(cfg.algo) >= 1)
    code, last = 0, {}
    try:
        for step in range(start_step, cfg.train.steps + 1):
            ckpt.poll()  # an asynchronous save whose writers are done is finished here
            before = recipe.draws()
            try:
                metrics = recipe.step(step)
            except RolloutLost as e:  # every rank, at the same point: the step changed nothing but its draws
                return _save_and_give_up(recipe, ckpt, step - 1, before, cfg, log, e)
            if recipe.eval_due(step):
                metrics |= recipe.evaluate(step)
            metrics |= alarms.check(step, metrics)  # health/alarms; action=warn logs each metric's first crossing
            metrics["step"] = step
            last = {k: v for k, v in last.items() if k.startswith("eval/")} | metrics  # the last eval stays
            sinks.log(step, metrics)
            progress.update(step, metrics)
            try:
                alarms.enforce()
            except DriftAlarm as e:  # every rank, at the same step: its metrics are the same everywhere
                code = _save_and_stop(ckpt, step, log, e)
                break
            stop = agree(_Stop.requested)
            if stop or (cfg.train.save_every and step % cfg.train.save_every == 0) or step == cfg.train.steps:
                ckpt.save(step)
                log.info("checkpoint of step %d %s; it held the step %.2f s", step,
                         "writing in the background" if cfg.train.async_save else "saved", ckpt.blocked_s)
            if stop:
                ckpt.wait()
                log.info("stop signal received: checkpoint of step %d saved; exiting", step)
                return 0
        ckpt.wait()  # the last checkpoint is finished before the run ends
    except KeyboardInterrupt as e:
        ckpt.close()  # a writer still running stops; its checkpoint stays unfinished (.tmp)
        log.warning("%s", e or "stopped at once")
        return 130
    except BaseException:
        ckpt.close()
        raise
    finally:
        progress.close()
        sinks.close()
        recipe.close()
    if not code:
        recipe.finish(out)
    if rank == 0:  # a run stopped by an alarm gets its report too: it shows why
        report = build_report(out) if cfg.log.report else None
        for line in end_of_run(out, cfg, last, report):
            log.info("%s", line)
    return code


def end_of_run(out: Path, cfg: RunConfig, last: dict[str, Any], report: list[Any] | None) -> list[str]:
    """What a run prints when it ends: its last step's key metrics, where the report is (the figures
    it skipped are listed in its index, not here), and the weights as a HF checkpoint (or the command
    that makes one)."""
    from moe_rl.observe.progress import format_step_line

    lines = [f"done: {format_step_line(int(last['step']), cfg.train.steps, last, None)}"] if last else []
    if report is not None:
        index = next(r.path for r in report if r.name == "index.md")
        figures = [r for r in report if r.name.endswith(".png")]
        skipped = sum(1 for r in figures if r.skipped)
        lines.append(f"report: {index} ({len(figures) - skipped} figures"
                     + (f"; {skipped} skipped for want of their metrics, listed there)" if skipped else ")"))
    ckpt = latest_checkpoint(out)
    if cfg.train.export_hf or cfg.train.mode == "dpo":
        lines.append(f"weights: {out / 'hf'} (a HF checkpoint)")
    elif ckpt is not None:
        lines.append(f"weights as a HF checkpoint: moe-rl export --checkpoint {ckpt} --out {out / 'hf'}")
    return lines


def _save_and_give_up(recipe: Any, ckpt: Checkpoints, last: int, before: dict[str, Any], cfg: RunConfig, log: Any,
                      error: Exception) -> int:
    """No rollout server recovered: checkpoint step `last` as it ended (draws undone), exit 3."""
    recipe.undo_draws(before)
    ckpt.wait()
    done = latest_checkpoint(ckpt.root.parent)
    if last >= 1 and (done is None or done.name != f"step_{last:06d}"):
        ckpt.save(last)
        ckpt.wait()
    log.error("no rollout server answered within rollout.timeout_s=%g s (%s); checkpoint of step %d saved, "
              "resume with train.resume=auto once the servers are back", cfg.rollout.timeout_s, error, last)
    return EXIT_NO_SERVER


def _save_and_stop(ckpt: Checkpoints, step: int, log: Any, alarm: DriftAlarm) -> int:
    """A drift alarm with action=stop fired on step `step`'s metrics: checkpoint that step (its weights
    are the ones in memory), keep the newest checkpoint from before it however small train.keep_last
    is (the last one the alarm did not see: where to go back to), and exit 4 naming the metric."""
    ckpt.wait()  # a save in flight is finished first: it is from before the alarm
    before = latest_checkpoint(ckpt.root.parent)
    ckpt.keep_last += 1  # this save prunes one fewer: the checkpoint from before the alarm stays
    ckpt.save(step)
    ckpt.wait()
    back = (f"; the last checkpoint from before it is {before.name} (train.resume={before} goes back there)"
            if before is not None and before.name != f"step_{step:06d}" else "")
    log.error("drift alarm (drift.alarm.action=stop): %s; checkpoint of step %d saved in %s%s; exit %d. Resume "
              "with train.resume=auto once the cause is addressed (a lower lr, routing replay, a rollout "
              "correction)", alarm, step, ckpt.root, back, EXIT_DRIFT_ALARM)
    return EXIT_DRIFT_ALARM
