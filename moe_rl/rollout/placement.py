"""Where the servers the trainer launches on its own machine run: which GPUs, or the CPU.

Trainer rank r uses GPU r (`cuda:LOCAL_RANK`), and the servers start after the policy is
built, so counting their GPUs from 0 would put server 0 on trainer rank 0's GPU: NCCL refuses
two ranks of one communicator there (the nccl weight sync), and SGLang's static memory
fraction collides with the trainer's. `plan_devices` counts them after the trainer's; the
preflight checks the plan against the GPUs this machine has before anything starts.
"""
from __future__ import annotations

from typing import Any

from moe_rl.rollout.engines import ENGINE_KINDS, WEIGHT_SYNC_KINDS, engine_kind


def plan_devices(engine: str, num_servers: int, tp: int, *, trainer_gpus: int, device_count: int,
                 colocated: bool = False, weight_sync: str = "disk") -> list[int | None]:
    """The first GPU of each server the trainer launches on its own machine (None: the CPU).

    Trainer rank r uses GPU r (`cuda:LOCAL_RANK`), so `trainer_gpus` (this machine's trainer
    ranks) GPUs from 0 are taken. SGLang servers each need `tp` GPUs of their own: after the
    trainer's (GPU `trainer_gpus + i * tp`), or, colocated, the trainer's own from GPU 0 (they
    release their memory while the trainer trains). `moe-rl serve` (one device each) goes on
    the GPUs after the trainer's and wraps around to share when there are fewer; with no GPU
    at all it runs on the CPU. Raises ValueError naming the fields when the machine's
    `device_count` GPUs do not fit the plan, or when a `moe-rl serve` would share trainer
    rank 0's GPU with the nccl weight sync (NCCL refuses two ranks of one communicator on one GPU).
    """
    if not ENGINE_KINDS[engine].tensor_parallel:  # moe-rl serve: one device each
        if device_count == 0:
            return [None] * num_servers
        first = 0 if colocated else trainer_gpus
        gpus: list[int | None] = [(first + i) % device_count for i in range(num_servers)]
        if WEIGHT_SYNC_KINDS[weight_sync].update_group and 0 in gpus:
            raise ValueError(f"rollout.weight_sync={weight_sync}: {num_servers} `moe-rl serve` server(s) on a machine with "
                             f"{device_count} GPU(s) and train.world_size={trainer_gpus} trainer rank(s) put a server "
                             "on trainer rank 0's GPU 0, and NCCL refuses two ranks of the update group on one GPU; "
                             "use rollout.weight_sync=disk, fewer trainer ranks or servers, or a machine with more GPUs")
        return gpus
    need = num_servers * tp + (0 if colocated else trainer_gpus)
    if need > device_count:
        where = ("on the trainer's GPUs (rollout.colocated=true)" if colocated
                 else f"after the {trainer_gpus} GPU(s) of the trainer ranks on this machine (train.world_size)")
        raise ValueError(f"rollout.num_servers={num_servers} SGLang server(s) x rollout.tp_size={tp} GPU(s) {where} "
                         f"need {need} GPU(s), but this machine has {device_count}; lower rollout.num_servers or "
                         "rollout.tp_size" + ("" if colocated else ", set rollout.colocated=true") +
                         ", or start the servers elsewhere and give their rollout.urls")
    first = 0 if colocated else trainer_gpus
    return [first + i * tp for i in range(num_servers)]


def server_gpus(cfg: Any, trainer_ranks: int, device_count: int) -> list[int | None] | None:
    """`plan_devices` for the servers a `RolloutConfig` has the trainer launch (None: it launches none)."""
    if getattr(cfg, "urls", None) or not engine_kind(cfg).runs_as_servers:
        return None
    tp = int(getattr(cfg, "server_tp_size", getattr(cfg, "tp_size", 1)))
    return plan_devices(cfg.engine, int(cfg.num_servers), tp, trainer_gpus=trainer_ranks, device_count=device_count,
                        colocated=bool(getattr(cfg, "colocated", False)), weight_sync=str(cfg.weight_sync))


def cpu_threads(trainer_ranks: int, servers_here: int, at_once: bool, cores: int) -> tuple[int, int | None]:
    """CPU threads for each trainer rank and for each `moe-rl serve` it launches on a machine
    without GPUs (None: torch's default, all cores).

    When the servers generate while the ranks train (`at_once`: algo.max_staleness >= 1), the
    trainer_ranks + servers_here processes compute together, and torch pools that each take
    every core thrash: on 2 cores, 1 rank and 1 server at K = 2 took 1.36 s per generation with
    2 threads each, 0.33 s with 1. So each gets an equal share. In turns (K = 0) each side has
    the cores while the other waits: the ranks split them, a server keeps its default.
    """
    if servers_here and at_once:
        share = max(1, cores // (trainer_ranks + servers_here))
        return share, share
    return max(1, cores // max(1, trainer_ranks)), None
