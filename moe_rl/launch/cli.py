"""`moe-rl launch slurm`: render a multi-node RL job as an sbatch script, and submit it.

    moe-rl launch slurm --config launch/configs/qwen3_30b_a3b_gspo.yaml --nodes 4 --rollout-nodes 2 \\
        --partition gpu --time 24:00:00 parallel.ep=4 --dry-run

`--rollout-nodes 0` (the default) is the colocated shape; `--rollout-nodes R` gives the
last R nodes to rollout servers. `--gpus-per-node 0` is CPU mode, for clusters without
GPUs (CI, rehearsals): no GPU is requested, the trainer runs `--tasks-per-node` gloo ranks
per node with `--cpus-per-task` CPUs each, and the servers are `moe-rl serve`:

    moe-rl launch slurm --config launch/configs/rehearsal_cpu.yaml --nodes 2 --rollout-nodes 1 \\
        --gpus-per-node 0 train.steps=3

Trailing `key.sub=value` words override the config for the trainer (and are checked now). Without `--dry-run` the config is copied to
`RUN_DIR/launch/config.yaml`, the script written to `RUN_DIR/launch/job.sbatch` and
submitted with sbatch; the job id is printed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from moe_rl.launch.plan import LaunchError, NodeShape
from moe_rl.launch.slurm import (DEFAULT_NCCL_IFNAME, SlurmOptions, freeze_config, render_script, submit,
                                 write_job)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`launch` has one target today, `slurm`; the level exists so others can sit beside it."""
    sub = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    p = sub.add_parser("slurm", help="render (and submit) a multi-node SLURM batch script",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="run config YAML (see launch/configs/)")
    p.add_argument("--nodes", type=int, required=True, help="nodes in the job")
    p.add_argument("--rollout-nodes", type=int, default=0,
                   help="nodes that only serve rollouts (default 0: colocated, every node trains and serves)")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node = trainer ranks per trainer node (default 8); 0 = CPU mode: no GPU "
                        "request, gloo ranks, rollout.engine=local (`moe-rl serve`)")
    p.add_argument("--tasks-per-node", type=int,
                   help="CPU mode: trainer ranks per trainer node (default: the config's train.world_size "
                        "divided by the trainer nodes, so a CPU config keeps its parallel layout)")
    p.add_argument("--cpus-per-task", type=int,
                   help="CPUs of each trainer rank and server. CPU mode: also their torch threads (default 1); "
                        "with GPUs the default is each node's CPUs shared by the tasks that run on it")
    p.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    p.add_argument("--run-dir", help="run directory (default: log.run_dir, else runs/<name>-<time>)")
    p.add_argument("--out", help="where to write the script (default RUN_DIR/launch/job.sbatch)")
    g = p.add_argument_group("cluster")
    g.add_argument("--job-name", help="default moe_rl-<log.name>")
    g.add_argument("--partition")
    g.add_argument("--account")
    g.add_argument("--time", help="time limit, e.g. 24:00:00 (default: the partition's)")
    g.add_argument("--signal-secs", type=int, default=300,
                   help="seconds before the time limit at which the trainer checkpoints and the job "
                        "requeues itself (--signal=B:USR1@N; 0 = off)")
    g.add_argument("--no-requeue", dest="requeue", action="store_false", help="do not pass --requeue")
    g.add_argument("--sbatch-arg", action="append", default=[], metavar="OPT",
                   help="one more #SBATCH option, e.g. --qos=high (repeatable)")
    g.add_argument("--nccl-ifname", default=DEFAULT_NCCL_IFNAME,
                   help=f"NCCL_SOCKET_IFNAME (default {DEFAULT_NCCL_IFNAME!r}: any but loopback/docker; '' = unset)")
    g.add_argument("--gloo-ifname", help="GLOO_SOCKET_IFNAME, an interface name such as ib0 (default unset)")
    g.add_argument("--container-image", help="run every moe_rl command in this image (pyxis/enroot srun flags); "
                                             "the batch host then needs no moe_rl")
    g.add_argument("--container-mounts", help="pyxis mounts (default RUN_DIR:RUN_DIR)")
    g.add_argument("--python", help="interpreter of every moe_rl command of the job, helpers included "
                                    "(default: this one; 'python' inside --container-image)")
    g.add_argument("--master-port", type=int, help="rendezvous port (default derived from the job id)")
    g.add_argument("--servers-per-node", type=int,
                   help="rollout servers per serving node (default: GPUs / server tp for SGLang; local engine: "
                        "rollout.num_servers spread over the serving nodes)")
    g.add_argument("--health-timeout", type=float, default=1800.0,
                   help="seconds the servers get to answer /health (large checkpoints load slowly)")
    g.add_argument("--stop-timeout", type=float, default=60.0, help="seconds from SIGTERM to SIGKILL on exit")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides for the trainer")


def _options(args: argparse.Namespace) -> SlurmOptions:
    return SlurmOptions(job_name=args.job_name, partition=args.partition, account=args.account, time=args.time,
                        signal_secs=args.signal_secs, requeue=args.requeue, nccl_ifname=args.nccl_ifname or None,
                        gloo_ifname=args.gloo_ifname, container_image=args.container_image,
                        container_mounts=args.container_mounts, python=args.python, master_port=args.master_port,
                        health_timeout=args.health_timeout, stop_timeout=args.stop_timeout,
                        servers_per_node=args.servers_per_node, sbatch_args=list(args.sbatch_arg))


def run_slurm(args: argparse.Namespace) -> int:
    """Render; then print it (--dry-run) or freeze the config, write the script and submit it."""
    shape = NodeShape(args.nodes, args.rollout_nodes, args.gpus_per_node, args.tasks_per_node, args.cpus_per_task)
    opts = _options(args)
    rendered = render_script(args.config, args.overrides, shape, opts, run_dir=args.run_dir)
    for note in rendered.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.dry_run:
        sys.stdout.write(rendered.text)
        return 0
    # The job reads a copy of the config: edits to the original while it waits in the queue do not leak in.
    frozen = freeze_config(args.config, rendered.run_dir)
    rendered = render_script(frozen, args.overrides, shape, opts, run_dir=rendered.run_dir)
    script = write_job(rendered, Path(args.out) if args.out else rendered.run_dir / "launch" / "job.sbatch")
    job = submit(script)
    print(f"submitted job {job}\n  script:  {script}\n  run dir: {rendered.run_dir}\n"
          f"  logs:    {rendered.run_dir / 'logs'} (slurm-{job}.out, job-{job}-<restart>/)")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        if args.target == "slurm":
            return run_slurm(args)
    except LaunchError as e:
        print(f"moe-rl launch {args.target}: {e}", file=sys.stderr)
        return 2
    raise AssertionError(f"unknown launch target {args.target!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point without the `moe-rl` dispatcher: `python -m moe_rl.launch.cli slurm ...`."""
    parser = argparse.ArgumentParser(prog="moe-rl launch", description="render and submit multi-node launch scripts")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
