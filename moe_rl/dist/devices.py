"""The compute device: where the policy's tensors live, and so where collective tensors must be.

Process groups of a GPU run are NCCL, which has no CPU backend: every tensor that
moe_rl hands to `torch.distributed` (all-reduces of counts and metrics, route
buffers, pipeline broadcasts, weight-sync sends) must sit on the compute device.
On a CPU machine the compute device is the CPU and gloo takes the same tensors.

Under the device guard (`moe_rl.dist.device_guard`, CPU only) the compute
device is a *simulated accelerator*, `cuda:0`: `moe_rl.policy.compat` maps every
cuda device argument to the CPU, so the maths is unchanged, while the guard
tracks which tensors were put on the device and rejects a host tensor in one of
moe_rl's collectives — the mistake a GPU run would otherwise find first.

No megatron imports here: policy/, drift/, the trainer and weight sync all use it.
"""
from __future__ import annotations

import os
import re
from typing import Mapping

import torch

_CPU = torch.device("cpu")
# What the guard's simulated accelerator is called; compat maps it to the CPU.
SIMULATED_DEVICE = torch.device("cuda", 0)
_simulated = False


def compute_device() -> torch.device:
    """The local CUDA device when CUDA is available; else the CPU, or the simulated
    accelerator `cuda:0` while the device guard is on."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return SIMULATED_DEVICE if _simulated else _CPU


def to_compute(t: torch.Tensor) -> torch.Tensor:
    """`t` on the compute device (itself when it is there already), for a collective."""
    return t.to(compute_device())


def simulate_accelerator(on: bool) -> None:
    """Switch the simulated accelerator on or off. Only the device guard calls this: it
    is the one that makes a cuda device on a CPU machine meaningful."""
    global _simulated
    if on and torch.cuda.is_available():
        raise RuntimeError("a simulated accelerator makes no sense where CUDA is available: "
                           "the real GPU already checks where collective tensors live")
    _simulated = bool(on)


def local_trainer_ranks(default: int, environ: Mapping[str, str] | None = None) -> int:
    """Trainer ranks on this machine, each on GPU `LOCAL_RANK`: torchrun's LOCAL_WORLD_SIZE, srun's
    tasks on this node (SLURM_NTASKS_PER_NODE, or the first count of SLURM_TASKS_PER_NODE, e.g. "4(x2)"),
    else `default` (the ranks `moe-rl train` spawns here: train.world_size)."""
    env = os.environ if environ is None else environ
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        m = re.match(r"\d+", env.get(key, ""))
        if m:
            return int(m.group())
    return int(default)


def gpu_count() -> int:
    """GPUs this process sees (0 on a CPU machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
