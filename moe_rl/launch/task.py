"""Commands a rendered sbatch script runs on its nodes: `python -m moe_rl.launch.task CMD ...`.

- `rank-env -- CMD...`: run CMD with torch's variables (RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT) derived from the variables
  srun gives each task, so every rank sees one consistent description of the job
  whatever reads it (torch, megatron, our trainer).
- `wait-healthy URL...`: poll each server's /health until all answer, a watched
  process dies, or the timeout passes (then name what is missing and where its logs are).
- `finished --run-dir D --steps N`: exit 0 when D holds a complete checkpoint of step N,
  3 when it does not (the job requeues itself only then, after a preemption signal).
- `prepare-model --config F [overrides]`: write the fresh model a config without
  `model.hf_path` trains, so rollout servers can load it before the trainer starts.

The first three import only the standard library: they start in milliseconds on
every task of a large job.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Mapping, Sequence


NOT_FINISHED = 3  # exit code of `finished` when steps remain (1 is left to errors)


class TaskError(RuntimeError):
    """The job cannot go on; the message says why (printed, exit code 1)."""


# ----------------------------------------------------------------------------- rank-env

def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node `node_id` from SLURM_TASKS_PER_NODE, e.g. `8(x4)` or `2(x2),1`."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise TaskError(f"cannot parse SLURM_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise TaskError(f"SLURM_NODEID={node_id} is outside SLURM_TASKS_PER_NODE={tasks_per_node!r}")
    return counts[node_id]


def rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """torch's launch variables for this srun task.

    MASTER_ADDR / MASTER_PORT must come from the batch script (it picks the first
    trainer node and a port for the job); the rest comes from srun's per-task variables.
    """
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID")
               if k not in environ]
    if missing:
        raise TaskError(f"rank-env runs under srun; missing {', '.join(missing)}")
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if not environ.get(key):
            raise TaskError(f"{key} is not set: the batch script exports it before srun")
    node = int(environ["SLURM_NODEID"])
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    local_world = tasks_on_node(per_node, node) if per_node else 1
    return {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": environ["SLURM_NTASKS"],
            "LOCAL_RANK": environ["SLURM_LOCALID"], "LOCAL_WORLD_SIZE": str(local_world),
            "NODE_RANK": str(node), "GROUP_RANK": str(node),
            "MASTER_ADDR": environ["MASTER_ADDR"], "MASTER_PORT": environ["MASTER_PORT"]}


def exec_with_rank_env(command: Sequence[str]) -> None:
    """Replace this process with `command`, run with `rank_env` added (never returns)."""
    if not command:
        raise TaskError("rank-env: no command given (usage: rank-env -- CMD ARGS...)")
    env = {**os.environ, **rank_env(os.environ)}
    os.execvpe(command[0], list(command), env)


# ----------------------------------------------------------------------------- wait-healthy

def _healthy(url: str, timeout: float, path: str = "/health") -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its parent counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust kill(pid, 0)
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def wait_healthy(urls: Sequence[str], timeout: float, watch: Sequence[int] = (), interval: float = 0.5,
                 log_hint: str = "", say: Callable[[str], None] = print, path: str = "/health") -> None:
    """Return once every URL answers `path` (/health; a router: /readiness) with 200; raise TaskError otherwise.

    `watch`: pids of the processes that run the servers (the srun steps): when one
    dies the servers cannot come up, so fail now instead of at the timeout.
    """
    start = time.monotonic()
    pending = list(dict.fromkeys(urls))
    next_note = start + 30.0
    while pending:
        pending = [u for u in pending if not _healthy(u, min(5.0, max(interval, 1.0)), path)]
        if not pending:
            break
        dead = [p for p in watch if not _alive(p)]
        hint = f"; logs: {log_hint}" if log_hint else ""
        if dead:
            raise TaskError(f"a server step exited (pid {', '.join(map(str, dead))}) before these answered "
                            f"{path}: {' '.join(pending)}{hint}")
        now = time.monotonic()
        if now - start > timeout:
            raise TaskError(f"not healthy after {timeout:g} s: {' '.join(pending)}{hint}")
        if now >= next_note:
            say(f"still waiting for {len(pending)} server(s) after {now - start:.0f} s: {' '.join(pending)}")
            next_note = now + 30.0
        time.sleep(interval)
    say(f"all {len(urls)} server(s) healthy after {time.monotonic() - start:.0f} s")


# ----------------------------------------------------------------------------- finished

def last_checkpoint_step(run_dir: str | Path) -> int:
    """Step of the newest complete checkpoint in `run_dir` (0 when there is none)."""
    from moe_rl.train.checkpoint import latest_checkpoint  # one definition of what "complete" means

    path = latest_checkpoint(Path(run_dir))
    if path is None:
        return 0
    import json

    return int(json.loads((path / "meta.json").read_text())["step"])


# ----------------------------------------------------------------------------- prepare-model

def prepare_model(config: str, overrides: Sequence[str], run_dir: str) -> Path:
    """The checkpoint the servers load: `model.hf_path`, or a fresh model written into the run dir
    exactly as trainer rank 0 would write it (the trainer then finds and reuses it)."""
    from moe_rl.config import load_config
    from moe_rl.data.dataset import load_dataset
    from moe_rl.recipes.build import initial_model

    cfg = load_config(config, list(overrides))
    if cfg.model.hf_path:
        return Path(cfg.model.hf_path)
    dataset = load_dataset(cfg.data.train, None, cfg.data.prompt_key, cfg.data.answer_key, cfg.data.max_prompt_len)
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    return initial_model(cfg, out, 0, dataset)


# ----------------------------------------------------------------------------- command line

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moe_rl.launch.task", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rank-env", help="run a command with torch's rank variables from srun's")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    w = sub.add_parser("wait-healthy", help="wait until servers answer /health")
    w.add_argument("--timeout", type=float, default=1800.0, help="seconds before giving up")
    w.add_argument("--watch", default="", help="space-separated pids that must stay alive meanwhile")
    w.add_argument("--logs", default="", help="where the servers' logs are (named in errors)")
    w.add_argument("--path", default="/health",
                   help="endpoint to poll (default /health; sglang-router: /readiness, since its /health "
                        "answers before any worker is registered)")
    w.add_argument("urls", nargs="+")
    f = sub.add_parser("finished", help="exit 0 when the run dir holds a checkpoint of the last step")
    f.add_argument("--run-dir", required=True)
    f.add_argument("--steps", type=int, required=True)
    k = sub.add_parser("write-keys", help="write fresh server keys to a file of mode 600 (SGLang --config YAML)")
    k.add_argument("path")
    m = sub.add_parser("prepare-model", help="write the fresh model of a config without model.hf_path")
    m.add_argument("--config", required=True)
    m.add_argument("--run-dir", required=True)
    m.add_argument("overrides", nargs="*")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "rank-env":
            cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
            exec_with_rank_env(cmd)
        elif args.cmd == "wait-healthy":
            pids = [int(p) for p in args.watch.split()]
            wait_healthy(args.urls, args.timeout, watch=pids, log_hint=args.logs,
                         say=lambda s: print(s, flush=True), path=args.path)
        elif args.cmd == "finished":
            step = last_checkpoint_step(args.run_dir)
            print(f"last complete checkpoint: step {step} of {args.steps}")
            return 0 if step >= args.steps else NOT_FINISHED
        elif args.cmd == "write-keys":
            from moe_rl.rollout.auth import RunKeys, write_key_file

            print(f"server keys: {write_key_file(args.path, RunKeys.new())}")
        elif args.cmd == "prepare-model":
            print(prepare_model(args.config, args.overrides, args.run_dir))
    except TaskError as e:
        print(f"moe_rl.launch.task {args.cmd}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
