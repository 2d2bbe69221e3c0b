"""Which nodes train, which serve rollouts, and how many servers each runs.

Two shapes:

- disaggregated (`rollout_nodes >= 1`): the first `nodes - rollout_nodes` nodes of
  the allocation run the trainer (one rank per GPU), the rest run rollout servers;
- colocated (`rollout_nodes == 0`): every node runs trainer ranks and servers on the
  same GPUs; SGLang then holds its memory only while it generates.

Everything here is checked before a script is written, so a layout that cannot
work fails on the login node with a message, not hours later in the queue.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

# Flags of `sglang.launch_server` that set its tensor-parallel size.
TP_FLAGS = ("--tp-size", "--tp", "--tensor-parallel-size")


class LaunchError(ValueError):
    """A launch request that cannot work; the message says what to change."""


@dataclass(frozen=True)
class NodeShape:
    """How the job's nodes are split between the trainer and the rollout servers."""

    nodes: int
    rollout_nodes: int
    gpus_per_node: int

    @property
    def colocated(self) -> bool:
        return self.rollout_nodes == 0

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
    def world_size(self) -> int:
        """Trainer ranks: one per GPU of every trainer node."""
        return self.train_nodes * self.gpus_per_node

    def validate(self) -> "NodeShape":
        if self.nodes < 1:
            raise LaunchError(f"--nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 1:
            raise LaunchError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if not 0 <= self.rollout_nodes < self.nodes:
            raise LaunchError(f"--rollout-nodes must be in [0, {self.nodes - 1}] for --nodes {self.nodes} "
                              f"(0 = colocated; the trainer needs at least one node), got {self.rollout_nodes}")
        return self


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
    SGLang's own command line, where those arguments come last), else `rollout.tp_size`."""
    args: Sequence[str] = [str(a) for a in rollout.sglang_args]
    tp = int(rollout.tp_size)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in TP_FLAGS:
            raw = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                tp = int(raw)
            except ValueError:
                raise LaunchError(f"rollout.sglang_args: {name} needs an integer, got {raw!r}") from None
    return tp


def plan_servers(rollout: Any, shape: NodeShape, servers_per_node: int | None = None,
                 router_supported: bool = True) -> ServerLayout:
    """The servers each serving node runs (see `ServerLayout`).

    SGLang: `gpus_per_node // tp` servers per node unless `servers_per_node` says
    fewer; a router when there is more than one server in all and the trainer can
    send weight updates past it (`router_supported`: the config has
    `rollout.admin_urls`). Local engine (`moe-rl serve`, CPU): one server per node
    by default and never a router (the trainer's client balances the servers).
    """
    if rollout.urls:
        raise LaunchError(f"rollout.urls is set ({', '.join(rollout.urls)}): the job starts its own servers "
                          "and passes their URLs to the trainer; remove rollout.urls from the config")
    engine = str(rollout.engine)
    base = int(rollout.base_port)
    if engine == "sglang":
        tp = server_tp(rollout)
        if tp > shape.gpus_per_node or shape.gpus_per_node % tp:
            raise LaunchError(f"an SGLang server with tp={tp} does not tile a node of {shape.gpus_per_node} GPUs; "
                              "use a server tp that divides --gpus-per-node")
        most = shape.gpus_per_node // tp
    elif engine == "local":
        tp, most = 1, max(1, shape.gpus_per_node)
    else:
        raise LaunchError(f"rollout.engine must be 'local' or 'sglang', got {engine!r}")
    n = servers_per_node if servers_per_node is not None else (most if engine == "sglang" else 1)
    if not 1 <= n <= most:
        raise LaunchError(f"--servers-per-node must be in [1, {most}] for engine {engine} "
                          f"(tp={tp}, {shape.gpus_per_node} GPUs per node), got {n}")
    router = engine == "sglang" and router_supported and n * shape.serve_nodes > 1
    if base + n + (1 if router else 0) > 65536:
        raise LaunchError(f"rollout.base_port={base} leaves no room for {n} servers below port 65536")
    return ServerLayout(engine, tp, tuple(base + i for i in range(n)), base + n if router else None)


def check_weight_sync(rollout: Any, shape: NodeShape) -> None:
    """Refuse `rollout.weight_sync=nccl` for SGLang servers that share the trainer's GPUs.

    In the colocated shape server 0 of a node uses the same GPUs as the trainer ranks
    there, trainer rank 0 among them; the nccl sync puts rank 0 and the servers in one
    communicator, and NCCL refuses two ranks on one GPU. The trainer's config check
    refuses `rollout.colocated=true` with nccl too; this message names the launch's fix.
    """
    if shape.colocated and str(rollout.engine) == "sglang" and str(rollout.weight_sync) == "nccl":
        raise LaunchError("rollout.weight_sync=nccl cannot work in the colocated shape (--rollout-nodes 0): the "
                          "SGLang servers share the trainer's GPUs and NCCL refuses two ranks on one GPU in a "
                          "communicator; use rollout.weight_sync=disk when colocated, or give the servers nodes "
                          "of their own with --rollout-nodes N")


def check_trainer_layout(parallel: Any, world_size: int) -> str:
    """Validate the trainer's parallel layout for `world_size` ranks; returns its short name.

    Raises LaunchError saying which sizes would fit.
    """
    from moe_rl.policy.parallel import LayoutError, ParallelLayout

    layout = ParallelLayout(tp=parallel.tp, pp=parallel.pp, vpp=parallel.vpp, ep=parallel.ep, etp=parallel.etp,
                            sp=parallel.sp, world_size=world_size)
    try:
        layout.validate()
    except LayoutError as e:
        raise LaunchError(f"{e} (the trainer has {world_size} ranks: trainer nodes x --gpus-per-node); "
                          "change --nodes / --rollout-nodes or the parallel.* overrides") from None
    return layout.name
