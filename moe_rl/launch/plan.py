"""Which nodes train, which serve rollouts, and how many servers each runs.

Two shapes:

- disaggregated (`rollout_nodes >= 1`): the first `nodes - rollout_nodes` nodes of
  the allocation run the trainer (one rank per GPU), the rest run rollout servers;
- colocated (`rollout_nodes == 0`): every node runs trainer ranks and servers on the
  same GPUs; SGLang then holds its memory only while it generates.

Either shape runs on GPUs or, with `gpus_per_node == 0`, on CPUs only (CPU mode):
no GPU is requested, each trainer node runs `tasks_per_node` ranks (gloo) of
`cpus_per_task` CPUs each, and the servers are `moe-rl serve` (SGLang needs GPUs).

Everything here is checked before a script is written, so a layout that cannot
work fails on the login node with a message, not hours later in the queue.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from moe_rl.rollout.config import SGLANG_TP_FLAGS, sglang_flag
from moe_rl.rollout.engines import engine_kind, weight_sync_kind

DEFAULT_BASE_PORT = 30000  # servers of a SLURM job listen from here (SGLang's usual range)
TP_FLAGS = SGLANG_TP_FLAGS  # flags of `sglang.launch_server` that set its tensor-parallel size


class LaunchError(ValueError):
    """A launch request that cannot work; the message says what to change."""


@dataclass(frozen=True)
class NodeShape:
    """How the job's nodes are split between the trainer and the rollout servers.

    `gpus_per_node == 0` is CPU mode: `tasks_per_node` trainer ranks per trainer node
    (None until `with_cpu_ranks` fills it from the config), `cpus_per_task` CPUs each.
    With GPUs there is one rank per GPU and both stay at their defaults.
    """

    nodes: int
    rollout_nodes: int
    gpus_per_node: int
    tasks_per_node: int | None = None
    cpus_per_task: int | None = None

    @property
    def colocated(self) -> bool:
        return self.rollout_nodes == 0

    @property
    def cpu(self) -> bool:
        """CPU mode: no GPU is requested anywhere in the job."""
        return self.gpus_per_node == 0

    @property
    def name(self) -> str:
        return "colocated" if self.colocated else "disaggregated"

    @property
    def train_nodes(self) -> int:
        return self.nodes if self.colocated else self.nodes - self.rollout_nodes

    @property
    def serve_nodes(self) -> int:
        return self.nodes if self.colocated else self.rollout_nodes

    @property
    def ranks_per_node(self) -> int:
        """Trainer ranks on each trainer node: one per GPU, or `tasks_per_node` in CPU mode."""
        if not self.cpu:
            return self.gpus_per_node
        if self.tasks_per_node is None:
            raise LaunchError("CPU mode (--gpus-per-node 0) needs --tasks-per-node (or train.world_size)")
        return self.tasks_per_node

    @property
    def world_size(self) -> int:
        """Trainer ranks: `ranks_per_node` on every trainer node."""
        return self.train_nodes * self.ranks_per_node

    def validate(self) -> "NodeShape":
        if self.nodes < 1:
            raise LaunchError(f"--nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise LaunchError(f"--gpus-per-node must be >= 0 (0 = CPU mode), got {self.gpus_per_node}")
        if not 0 <= self.rollout_nodes < self.nodes:
            raise LaunchError(f"--rollout-nodes must be in [0, {self.nodes - 1}] for --nodes {self.nodes} "
                              f"(0 = colocated; the trainer needs at least one node), got {self.rollout_nodes}")
        if not self.cpu and self.tasks_per_node is not None:
            # One rank per GPU: a second way to say how many would only disagree with the first.
            raise LaunchError(f"--tasks-per-node is for CPU mode (--gpus-per-node 0); with GPUs the trainer runs "
                              f"one rank per GPU ({self.gpus_per_node} per node): drop --tasks-per-node")
        for flag, value in (("--tasks-per-node", self.tasks_per_node), ("--cpus-per-task", self.cpus_per_task)):
            if value is not None and value < 1:
                raise LaunchError(f"{flag} must be >= 1, got {value}")
        return self


def with_cpu_ranks(shape: NodeShape, world_size: int) -> NodeShape:
    """CPU mode: fill the defaults, `tasks_per_node = world_size / trainer nodes` and 1 CPU per task.

    `world_size` is the config's `train.world_size`, the rank count its single-machine
    runs use, so a CPU config keeps its parallel layout on SLURM without a flag.
    GPU shapes come back unchanged.
    """
    if not shape.cpu:
        return shape
    tasks = shape.tasks_per_node
    if tasks is None:
        if world_size % shape.train_nodes:
            raise LaunchError(f"train.world_size={world_size} ranks do not split evenly over {shape.train_nodes} "
                              "trainer node(s); pass --tasks-per-node N (trainer ranks per trainer node) or change "
                              "--nodes / --rollout-nodes")
        tasks = world_size // shape.train_nodes
    return dataclasses.replace(shape, tasks_per_node=tasks, cpus_per_task=shape.cpus_per_task or 1)


@dataclass(frozen=True)
class ServerLayout:
    """Rollout servers on each serving node, and the router in front of them (if any).

    Server i of a node listens on `ports[i]` and, for SGLang, uses GPUs
    `[i * tp, (i + 1) * tp)` of that node. The router runs on the first serving node.
    """

    engine: str
    tp: int
    ports: tuple[int, ...]
    router_port: int | None

    @property
    def per_node(self) -> int:
        return len(self.ports)

    @property
    def use_router(self) -> bool:
        return self.router_port is not None


def server_tp(rollout: Any) -> int:
    """Tensor-parallel size of one SGLang server: the last `--tp-size` in `sglang_args` wins (as on
    SGLang's own command line, where those arguments come last), else `rollout.tp_size`
    (`RolloutConfig.server_tp_size`, which every path reads)."""
    raw = sglang_flag(rollout.sglang_args, TP_FLAGS)
    if raw is None:
        return int(rollout.tp_size)
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"rollout.sglang_args: --tp-size needs an integer, got {raw!r}") from None


def plan_servers(rollout: Any, shape: NodeShape, servers_per_node: int | None = None,
                 router_supported: bool = True) -> ServerLayout:
    """The servers each serving node runs (see `ServerLayout`).

    SGLang: `gpus_per_node // tp` servers per node unless `servers_per_node` says
    fewer; refused in CPU mode. Local engine (`moe-rl serve`): `rollout.num_servers`
    spread over the serving nodes by default (at most one per GPU with GPUs). A router
    goes in front by `moe_rl.rollout.launcher.wants_router`'s rule (`rollout.router`:
    None = SGLang with more than one server in all, true = always, false = never),
    when the trainer can send weight updates past it (`router_supported`: the config
    has `rollout.admin_urls`).
    """
    if rollout.urls:
        raise LaunchError(f"rollout.urls is set ({', '.join(rollout.urls)}): the job starts its own servers "
                          "and passes their URLs to the trainer; remove rollout.urls from the config")
    kind = engine_kind(rollout)
    engine = kind.name
    base = int(rollout.base_port or DEFAULT_BASE_PORT)  # fixed: other nodes must know where to connect
    most: int | None
    if not kind.runs_as_servers:
        raise LaunchError(f"rollout.engine={engine} runs as {kind.what} of a one-machine run; a SLURM job "
                          "launches rollout servers: use rollout.engine=local (CPU) or sglang")
    if kind.gpu_only:
        if shape.cpu:
            raise LaunchError("rollout.engine=sglang needs GPUs, and --gpus-per-node 0 (CPU mode) requests none: "
                              "set rollout.engine=local for a CPU job (`moe-rl serve` speaks SGLang's HTTP API), "
                              "or pass --gpus-per-node N")
        tp = server_tp(rollout)
        if tp > shape.gpus_per_node or shape.gpus_per_node % tp:
            raise LaunchError(f"an SGLang server with tp={tp} does not tile a node of {shape.gpus_per_node} GPUs; "
                              "use a server tp that divides --gpus-per-node")
        most = shape.gpus_per_node // tp
        default = most
    else:
        # CPU mode has no per-GPU bound: each server is a task with --cpus-per-task CPUs.
        tp, most = 1, (None if shape.cpu else shape.gpus_per_node)
        default = -(-int(rollout.num_servers) // shape.serve_nodes)  # ceil: at least num_servers in all
        default = default if most is None else min(default, most)
    n = servers_per_node if servers_per_node is not None else default
    if n < 1 or (most is not None and n > most):
        bound = f"[1, {most}]" if most is not None else ">= 1"
        where = "CPU mode" if shape.cpu else f"{shape.gpus_per_node} GPUs per node"
        raise LaunchError(f"--servers-per-node must be {'in ' if most is not None else ''}{bound} for engine "
                          f"{engine} (tp={tp}, {where}), got {n}")
    router = _router(rollout, engine, n * shape.serve_nodes, router_supported)
    if base + n + (1 if router else 0) > 65536:
        raise LaunchError(f"rollout.base_port={base} leaves no room for {n} servers below port 65536")
    return ServerLayout(engine, tp, tuple(base + i for i in range(n)), base + n if router else None)


def _router(rollout: Any, engine: str, total: int, router_supported: bool) -> bool:
    """Whether sglang-router goes in front of the job's `total` servers.

    The rule is the single-machine launcher's (`wants_router`), asked about the servers
    the job runs rather than `rollout.num_servers`.
    """
    from moe_rl.rollout.launcher import wants_router

    choice = getattr(rollout, "router", None)
    try:
        wanted = wants_router(SimpleNamespace(engine=engine, router=choice, num_servers=total))
    except ValueError as e:
        raise LaunchError(str(e)) from None
    if wanted and not router_supported:
        if choice:
            raise LaunchError("rollout.router=true, but this trainer has no rollout.admin_urls to reach the "
                              "servers behind a router for weight updates; set rollout.router=false")
        return False
    return wanted


def check_weight_sync(rollout: Any, shape: NodeShape) -> None:
    """Refuse `rollout.weight_sync=nccl` for SGLang servers that share the trainer's GPUs.

    In the colocated shape server 0 of a node uses the same GPUs as the trainer ranks
    there, trainer rank 0 among them; the nccl sync puts rank 0 and the servers in one
    communicator, and NCCL refuses two ranks on one GPU. The trainer's config check
    refuses `rollout.colocated=true` with nccl too; this message names the launch's fix.
    """
    if shape.colocated and engine_kind(rollout).gpu_only and weight_sync_kind(rollout).update_group:
        raise LaunchError(f"rollout.weight_sync={rollout.weight_sync} cannot work in the colocated shape "
                          "(--rollout-nodes 0): the SGLang servers share the trainer's GPUs and NCCL refuses two ranks on one GPU in a "
                          "communicator; use rollout.weight_sync=disk when colocated, or give the servers nodes "
                          "of their own with --rollout-nodes N")


def check_trainer_layout(parallel: Any, world_size: int, per_node_flag: str = "--gpus-per-node") -> str:
    """Validate the trainer's parallel layout for `world_size` ranks; returns its short name.

    `per_node_flag`: the flag that set the ranks per node (`--tasks-per-node` in CPU mode),
    named in the error. Raises LaunchError saying which sizes would fit.
    """
    from moe_rl.policy.parallel import LayoutError, ParallelLayout

    layout = ParallelLayout.of(parallel, world_size)
    try:
        layout.validate()
    except LayoutError as e:
        raise LaunchError(f"{e} (the trainer has {world_size} ranks: trainer nodes x {per_node_flag}); "
                          "change --nodes / --rollout-nodes or the parallel.* overrides") from None
    return layout.name
