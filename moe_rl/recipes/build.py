"""Everything a run is built from, in order: the initial model checkpoint, the megatron policy
(layout, optimizer, LR schedule, fused kernels), the critic, the rollout engine and its servers,
the weight sync and its update group. `moe_rl.train.driver` builds a run with `build_run`; the DPO
recipe takes the policy, model and tokenizer builders from here too."""
from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moe_rl.algo.config import staleness_bound, uses_critic
from moe_rl.config import ConfigError, RunConfig, handoff_timeout_s
from moe_rl.data.toy import ToyTokenizer, save_toy_tokenizer
from moe_rl.dist.collectives import all_gather_objects, barrier, broadcast_object, init_control_group
from moe_rl.dist.ports import free_port
from moe_rl.rollout.config import intake_on_heads, pause_mode, pushes_in_place
from moe_rl.rollout.engines import engine_kind, weight_sync_kind


def build_run(cfg: RunConfig, out: Path, rank: int) -> dict[str, Any]:
    """Model checkpoint, policy, data, rewards, rollout engine and weight sync for this rank."""
    from moe_rl.data.dataset import load_dataset
    from moe_rl.data.sampler import PromptSampler
    from moe_rl.recipes.rl.async_rollouts import AsyncRollouts, StalenessGovernor
    from moe_rl.recipes.rl.rollouts import SyncRollouts
    from moe_rl.recipes.rl.run import Run
    from moe_rl.reward.registry import get_reward
    from moe_rl.reward.runner import RewardRunner
    from moe_rl.rollout.weight_sync import make_weight_sync

    dataset = load_dataset(cfg.data.train, run_tokenizer(cfg), cfg.data.prompt_key, cfg.data.answer_key,
                           cfg.data.max_prompt_len)
    runner = RewardRunner(get_reward(cfg.reward.name, data=cfg.data.train), cfg.reward.max_failure_frac)
    if getattr(dataset.tokenizer, "decode", None) is None and not runner.reads_ids:
        raise ConfigError(f"reward.name={cfg.reward.name!r} reads only the completion text, but {cfg.data.train} "
                          "comes without a tokenizer to decode completions with: set model.hf_path to a checkpoint "
                          "with tokenizer files, or use a reward with a completion_ids parameter")
    hf_dir = initial_model(cfg, out, rank, dataset)
    launched = launch_servers(cfg, hf_dir, out) if rank == 0 else None  # they load while the policy is built
    policy = make_policy(cfg, hf_dir, cfg.algo.num_minibatches, temperature=cfg.rollout.temperature)
    init_control_group(handoff_timeout_s(cfg))  # from here on, waits for rank 0 cannot time out first
    eos = getattr(dataset.tokenizer, "eos_token_id", None)
    if eos is None:
        eos = policy.hf_config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    sampler = PromptSampler(len(dataset), cfg.data.prompts_per_step, seed=cfg.data.shuffle_seed)
    engine, servers, reach = (start_engine(cfg, hf_dir, policy, launched) if rank == 0 else (None, None, None))
    # every rank that owns tensors talks to the servers (nccl): each needs the run's admin key
    keys = broadcast_object(getattr(engine, "keys", None))
    reach = broadcast_object(reach)
    # rollout.intake, resolved once and alike everywhere: can every head reach the servers?
    on_heads = intake_on_heads(cfg.rollout, (reach or {}).get("urls", ()), all_gather_objects(socket.gethostname()))
    intake = sample_intake(cfg, policy, rank, on_heads)
    if on_heads:  # each data-parallel head a client of the servers for its own groups
        if intake.is_head and rank != 0:
            engine = sglang_client(cfg, policy, hf_dir, reach, heads=len(intake.heads))
    sync = make_weight_sync(cfg, root=out / "weights", keep_last=2, keys=keys,
                            **(update_group(cfg, servers, out) if weight_sync_kind(cfg.rollout).update_group else {}))
    depth = staleness_bound(cfg.algo)
    governor = (StalenessGovernor(cfg.algo.auto_staleness_kl, cfg.algo.auto_staleness_steps)
                if cfg.algo.auto_staleness else None)
    receives = engine is not None  # this rank asks the servers for samples (rank 0, or a head)
    asks = {"draw": intake.draw, "request": intake.request} if on_heads else {}
    run = Run(cfg=cfg, policy=policy, dataset=dataset, sampler=sampler, rewards=runner, engine=engine,
              weight_sync=sync, eos_id=int(eos) if eos is not None else -1, rank=rank,
              critic=build_critic(cfg, policy.spec) if uses_critic(cfg.algo) else None,
              rollouts=AsyncRollouts(depth, governor, **asks) if depth and receives else SyncRollouts(**asks),
              episodes=episode_runner(cfg, dataset.tokenizer, policy.hf_config, eos) if receives else None,
              intake=intake)
    eval_set = load_dataset(cfg.data.eval, run_tokenizer(cfg), cfg.data.prompt_key, cfg.data.answer_key,
                            cfg.data.max_prompt_len) if cfg.data.eval and cfg.train.eval_every else None
    return {"run": run, "eval": eval_set, "servers": servers}


def sample_intake(cfg: RunConfig, policy: Any, rank: int, on_heads: bool) -> Any:
    """Who receives the step's samples (`rollout.intake`), made on every rank (heads: collective)."""
    if on_heads:
        from moe_rl.recipes.rl.heads import HeadsIntake

        return HeadsIntake(rank, policy.dp_rank, policy.model_parallel_ranks, cfg.data.prompts_per_step)
    from moe_rl.recipes.rl.batch import RankZeroIntake

    return RankZeroIntake()


def episode_runner(cfg: RunConfig, tokenizer: Any, hf_config: dict[str, Any], eos_id: int | None) -> Any:
    """Rank 0's multi-turn episode loop against `rollout.env` (None without one)."""
    r = cfg.rollout
    if r.env is None:
        return None
    from moe_rl.env.registry import make_env
    from moe_rl.rollout.episodes import EpisodeRunner

    try:
        factory = make_env(r.env, eos_id=eos_id, tokenizer=tokenizer, vocab_size=hf_config.get("vocab_size"))
    except (KeyError, ImportError, TypeError, ValueError) as e:
        raise ConfigError(str(e.args[0]) if e.args else str(e)) from None
    return EpisodeRunner(factory, r.max_turns, r.max_episode_tokens, -1 if eos_id is None else int(eos_id),
                         r.episode_reward)


def make_policy(cfg: RunConfig, hf_dir: Path, updates_per_step: int, temperature: float = 1.0) -> Any:
    """The megatron policy of `hf_dir` in the configured layout, optimizer and LR schedule; its
    log-probs are of softmax(logits / `temperature`) (RL: the rollout's sampling temperature)."""
    from moe_rl.policy.lora import LoraSpec
    from moe_rl.policy.parallel import ParallelLayout, read_dist_env
    from moe_rl.policy.policy import Policy, PolicySpec

    p = cfg.parallel
    layout = ParallelLayout.of(p, read_dist_env().world_size)
    return Policy(PolicySpec(str(hf_dir), layout, optim_config(cfg, updates_per_step), cfg.model.dtype,
                             cfg.model.recompute, p.micro_batch_size, cfg.model.seed, p.max_tokens_per_microbatch,
                             temperature=temperature, moe_aux_loss_coef=cfg.model.moe_aux_loss_coef,
                             expert_bias_update_rate=cfg.model.expert_bias_update_rate,
                             collective_timeout_s=cfg.train.collective_timeout_s, perf=perf_request(cfg),
                             lora=LoraSpec.of(cfg.model)))


def optim_config(cfg: RunConfig, updates_per_step: int) -> Any:
    """The `train` section as the optimizer's `OptimConfig`. Its scheduler counts optimizer updates,
    `updates_per_step` per RL step, and `train.steps` and `train.warmup_steps` count RL steps."""
    from moe_rl.policy.train_step import OptimConfig

    t = cfg.train
    return OptimConfig(lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                       adam_beta2=t.adam_beta2, grad_clip=t.grad_clip, warmup_steps=t.warmup_steps * updates_per_step,
                       total_steps=t.steps * updates_per_step, lr_schedule=t.lr_schedule,
                       distributed_optimizer=t.distributed_optimizer)


def perf_request(cfg: RunConfig) -> Any:
    """The fused kernels and DDP overlap the config asks for (`model.*_fusion`, `parallel.overlap_*`)."""
    from dataclasses import fields

    from moe_rl.policy.perf import PerfRequest

    return PerfRequest(**{f.name: getattr(cfg.model, f.name, None) if hasattr(cfg.model, f.name)
                          else getattr(cfg.parallel, f.name) for f in fields(PerfRequest)})


def build_critic(cfg: RunConfig, policy_spec: Any) -> Any:
    """The value model of `algo.advantage=gae`: the policy's layout and batching, its own checkpoint
    (`critic.hf_path`, default the policy's) and a constant learning rate `critic.lr`."""
    from dataclasses import replace

    from moe_rl.policy.critic import Critic

    c = cfg.critic
    optim = replace(policy_spec.optim, lr=c.lr, min_lr=0.0, warmup_steps=0, lr_schedule="constant",
                    total_steps=cfg.train.steps * cfg.algo.num_minibatches * c.updates_per_step)
    return Critic(replace(policy_spec, hf_dir=c.hf_path or policy_spec.hf_dir, optim=optim))


def run_tokenizer(cfg: RunConfig) -> Any:
    """The tokenizer text rows are encoded with: `model.hf_path`'s own (None for a checkpoint without
    tokenizer files: id rows only); for a fresh tiny model whose vocabulary is the toy tasks'
    (`model.tiny.vocab_size=16`, as launch/configs/tiny_cpu.yaml), the toy tokenizer, so rows of your
    own in its alphabet (digits, `+ - =`) train on CPU; any other fresh model, None."""
    if not cfg.model.hf_path:
        toy = ToyTokenizer()
        return toy if cfg.model.tiny.vocab_size == toy.vocab_size else None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(cfg.model.hf_path)
    except Exception:  # id-only checkpoints (no tokenizer files) are fine for id datasets
        return None


def initial_model(cfg: RunConfig, out: Path, rank: int, dataset: Any) -> Path:
    """`model.hf_path`, or a fresh tiny model (`model.tiny.family`) written by rank 0 into the run directory."""
    if cfg.model.hf_path:
        return Path(cfg.model.hf_path)
    path = out / "init_model"
    if rank == 0 and not (path / "config.json").is_file():
        from moe_rl.policy.families.registry import make_tiny
        from moe_rl.policy.tiny import TinyMoEConfig

        tok = dataset.tokenizer
        shape = asdict(cfg.model.tiny)
        init_std, family = shape.pop("init_std"), shape.pop("family")
        tiny = TinyMoEConfig(**shape)
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tok, attr, None) is not None:
                setattr(tiny, attr, int(getattr(tok, attr)))
        make_tiny(family, path.with_suffix(".tmp"), seed=cfg.model.seed, config=tiny, init_std=init_std)
        if isinstance(tok, ToyTokenizer):  # the model's text is the toy alphabet: its exports load with AutoTokenizer
            save_toy_tokenizer(path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    if dist.is_initialized():
        barrier()
    else:
        while not (path / "config.json").is_file():  # other ranks wait for rank 0's write
            time.sleep(0.2)
    return path


def update_group(cfg: RunConfig, servers: Any, out: Path | None = None) -> dict[str, Any]:
    """Where the nccl weight sync meets the servers (collective; every rank gets rank 0's answer).

    The servers join a process group whose rank 0 is trainer rank 0: they reach it at
    MASTER_ADDR (under torchrun / srun the host of rank 0, which the servers' nodes can
    resolve) on `rollout.weight_sync_port`, or on a port rank 0 finds free on all its
    interfaces, never MASTER_PORT (the trainer's own rendezvous). Each server joins with
    its `--tp-size` ranks (`rollout.tp_size`; `moe-rl serve` is one rank). The group is
    NCCL on GPUs and gloo on CPU, where `moe-rl serve` receives the same broadcasts.
    """
    found = None
    if int(os.environ.get("RANK", "0")) == 0:
        r = cfg.rollout
        admin = list(r.admin_urls) or list(r.urls) or (servers.admin_urls if servers is not None else [])
        found = {"admin_urls": admin,
                 "master_address": os.environ.get("MASTER_ADDR", "127.0.0.1"),
                 "master_port": r.weight_sync_port or free_port("", avoid=int(os.environ.get("MASTER_PORT", "0"))),
                 "server_tp_sizes": engine_kind(r).server_tp(r),
                 # the group joined last, left by a trainer that died without leaving it
                 "state_file": None if out is None else str(out / "servers" / "update_group.json"),
                 "backend": "nccl" if torch.cuda.is_available() else "gloo"}
    return broadcast_object(found)  # the others wait while rank 0 starts the servers


def inflight_client_args(cfg: RunConfig) -> dict[str, Any]:
    """An in-place push (rollout.inflight_update) asks for no cache flush, and its samples' version spans
    are read as overlapping SGLang servers label them; the samples a push pauses (in place or retracted)
    may hold tokens of the last algo.max_staleness + 1 pushed versions."""
    paused = pause_mode(cfg.rollout, staleness_bound(cfg.algo)) is not None
    in_place = pushes_in_place(cfg.rollout)
    return {"flush_on_update": not in_place, "pushes_in_place": in_place,
            "version_lag": staleness_bound(cfg.algo) if paused else 0}


def cpu_threads_of(cfg: RunConfig) -> tuple[int, int | None]:
    """Threads for each trainer rank `moe-rl train` spawns on this machine and for each server it
    launches here (None: the server's default): `placement.cpu_threads` with the run's counts. GPU
    machines (and servers elsewhere) keep what they had: the ranks split the cores."""
    from moe_rl.dist.devices import gpu_count
    from moe_rl.rollout.placement import cpu_threads

    r = cfg.rollout
    here = r.num_servers if engine_kind(r).runs_as_servers and not r.urls and gpu_count() == 0 else 0
    return cpu_threads(int(cfg.train.world_size), here, staleness_bound(cfg.algo) >= 1, os.cpu_count() or 1)


def launch_servers(cfg: RunConfig, hf_dir: Path, out: Path) -> tuple[Any, Any] | None:
    """Rank 0: start the rollout servers this run launches itself (none with `rollout.urls` or an
    in-process engine): (server group, run identity), not waited for yet, so that they load their
    model while the ranks build the policy."""
    from moe_rl.dist.devices import gpu_count, local_trainer_ranks
    from moe_rl.rollout.launcher import RunIdentity, ServerGroup
    from moe_rl.rollout.placement import server_gpus

    r = cfg.rollout
    if not engine_kind(r).runs_as_servers or r.urls:
        return None
    # fresh run id (and keys off loopback), supervised; weights only from ours: the versions synced and
    # the checkpoint they started from (reloaded after a colocated release, which loses them)
    identity = RunIdentity.for_run(out, r.host, trusted_dirs=[out / "weights", hf_dir])
    gpus = server_gpus(r, local_trainer_ranks(cfg.train.world_size), gpu_count())  # after the trainer's GPUs
    threads = cpu_threads_of(cfg)[1]  # servers that generate while the ranks train share the cores
    servers = ServerGroup.from_config(r, hf_dir, out / "servers", identity=identity, gpus=gpus,
                                      env={"OMP_NUM_THREADS": str(threads)} if threads else None).start()
    if weight_sync_kind(r).update_group:  # a restarted server could not rejoin it: it would serve stale weights
        servers.max_restarts = 0
    return servers, identity


def start_engine(cfg: RunConfig, hf_dir: Path, policy: Any, launched: tuple[Any, Any] | None
                 ) -> tuple[Any, Any, dict[str, Any] | None]:
    """Rank 0: connect to `rollout.urls`, or to the servers `launch_servers` started once they are
    healthy; (client, server group or None, how to reach the servers: `sglang_client`'s `reach`)."""
    from moe_rl.rollout.auth import read_key_file

    if not engine_kind(cfg.rollout).runs_as_servers:  # rollout.engine=inprocess: the engine runs in this process
        from moe_rl.rollout.inprocess import inprocess_engine

        return inprocess_engine(cfg, hf_dir), None, None
    servers = None
    r = cfg.rollout
    reach = {"urls": list(r.urls), "admin": list(r.admin_urls) or None, "served_name": r.served_model_name,
             "keys": read_key_file(r.api_key_file) if r.api_key_file else None}
    if launched is not None:  # launched here
        servers, identity = launched
        servers.wait_healthy(timeout=r.timeout_s)
        servers.watch()
        reach = {"urls": servers.urls, "admin": servers.admin_urls, "keys": identity.keys,
                 "served_name": identity.run_id}
    return sglang_client(cfg, policy, hf_dir, reach), servers, reach


def sglang_client(cfg: RunConfig, policy: Any, hf_dir: Path, reach: dict[str, Any], heads: int = 1) -> Any:
    """A client of the rollout servers at `reach` (urls, admin urls, keys, served name); `heads`: the
    clients that share `rollout.concurrency` (rollout.intake=heads: one per data-parallel head)."""
    from moe_rl.rollout.sglang_client import SGLangClient

    arch, r = policy.arch, cfg.rollout
    return SGLangClient(reach["urls"], admin_urls=reach["admin"], max_concurrency=-(-r.concurrency // heads),
                        keys=reach["keys"], served_name=reach["served_name"], no_server_timeout=r.timeout_s,
                        request_timeout=r.timeout_s, max_attempts=r.retries + 1,
                        num_layers=arch.num_layers, topk=arch.moe_router_topk,
                        num_experts=arch.num_moe_experts, moe_layer_ids=list(arch.moe_layers),
                        initial_weights=hf_dir, **inflight_client_args(cfg))
