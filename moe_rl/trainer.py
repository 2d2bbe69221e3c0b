"""`moe-rl train`: build everything from `RunConfig`, run RL steps, checkpoint, report.

Single machine: `train.world_size` trainer processes are spawned here (gloo on CPU,
nccl on GPU). Under torchrun or srun (RANK / SLURM_PROCID set) this process is one
rank of the job and nothing is spawned.

The run directory (printed at start): config.yaml, metrics.jsonl, tb/, train.log,
checkpoints/, weights/ (versions synced to the engine), servers/ (engine logs), report/.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moe_rl.config import ConfigError, RunConfig, load_config
from moe_rl.integrity import check_file, file_record, read_meta
from moe_rl.rollout.outage import EXIT_NO_SERVER, RolloutLost

CHECKPOINTS = "checkpoints"


# ---------------------------------------------------------------- CLI

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="run config YAML (see launch/configs/)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="config overrides, e.g. algo.loss=sapo train.steps=40")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"moe-rl train: {e}", file=sys.stderr)
        return 2
    run_dir = resolve_run_dir(cfg)
    launched = "RANK" in os.environ or "SLURM_PROCID" in os.environ
    problem = _preflight(cfg, launched)
    if problem:
        print(f"moe-rl train: {problem}", file=sys.stderr)
        if run_dir.is_dir() or cfg.log.run_dir:  # a run directory that exists or was named gets it too
            run_dir.mkdir(parents=True, exist_ok=True)
            with open(run_dir / "train.log", "a") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR moe_rl: {problem}\n")
        return 2
    if launched:
        return train_rank(cfg, str(run_dir))
    print(f"run directory: {run_dir}", flush=True)
    if cfg.train.world_size == 1:
        return _single(cfg, str(run_dir))
    return spawn(cfg, str(run_dir))


def _preflight(cfg: RunConfig, launched: bool) -> str | None:
    """`moe_rl.preflight` for the world this run will have (the launcher's, or train.world_size)."""
    from moe_rl.policy.parallel import read_dist_env
    from moe_rl.preflight import preflight

    return preflight(cfg, read_dist_env().world_size if launched else cfg.train.world_size)


def resolve_run_dir(cfg: RunConfig) -> Path:
    """`log.run_dir`, or a resumed run's directory, or `runs/<name>-<timestamp>`."""
    if cfg.log.run_dir:
        return Path(cfg.log.run_dir)
    if cfg.train.resume and cfg.train.resume != "auto":
        return Path(cfg.train.resume).resolve().parents[1]
    return Path("runs") / f"{cfg.log.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _single(cfg: RunConfig, run_dir: str) -> int:
    from moe_rl.ports import free_port

    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    return train_rank(cfg, run_dir)


def spawn(cfg: RunConfig, run_dir: str) -> int:
    """Start `train.world_size` local ranks; a rank's failure ends the run with its traceback."""
    import torch.multiprocessing as mp

    from moe_rl.ports import free_port

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
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    code = train_rank(RunConfig.from_dict(cfg_dict), run_dir, spawned=True)
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
    from moe_rl.observe.report import write_report
    from moe_rl.observe.sinks import make_sinks

    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = setup_logging(cfg.log.level, rank, cfg.log.all_ranks, out / "train.log")
    if rank == 0:
        (out / "config.yaml").write_text(cfg.to_yaml())  # the resolved config, overrides applied
    if cfg.algo.replay == "auto":
        from moe_rl.config import replay_mode

        log.info("algo.replay=auto: %s (%d optimizer updates per rollout batch%s)", replay_mode(cfg.algo),
                 cfg.algo.num_minibatches, ", one weight version stale" if cfg.algo.off_policy_overlap else "")
    _Stop.install(spawned)
    if cfg.train.device_guard:  # CPU rehearsal: a host tensor in a collective fails here, not on a GPU
        from moe_rl.device_guard import install_device_guard

        install_device_guard()
    dpo = cfg.train.mode == "dpo"
    if dpo:  # preference pairs, no rollout servers, no weight sync (moe_rl/dpo.py)
        from moe_rl.dpo import build_dpo_run, dpo_step as step_fn, evaluate
    else:
        from moe_rl.loop import rl_step as step_fn
        from moe_rl.rollout_batch import evaluate
    built = (build_dpo_run if dpo else build_run)(cfg, out, rank)
    run, eval_set, servers = built["run"], built["eval"], built["servers"]
    sinks = make_sinks(cfg.log, out, cfg.to_dict(), rank)
    start_step = resume(run, cfg, out, log) + 1
    progress = Progress(cfg.train.steps, enabled=rank == 0, live=None if cfg.log.progress else False)
    try:
        for step in range(start_step, cfg.train.steps + 1):
            before = _step_state(run)
            try:
                metrics = step_fn(run, step)
            except RolloutLost as e:  # every rank, at the same point: the step changed nothing but its draws
                return _save_and_give_up(run, out, step - 1, before, cfg, log, e)
            if eval_set is not None and cfg.train.eval_every and step % cfg.train.eval_every == 0:
                metrics |= evaluate(run, eval_set, step)
            metrics["step"] = step
            sinks.log(step, metrics)
            progress.update(step, metrics)
            stop = _agree(_Stop.requested)
            if stop or (cfg.train.save_every and step % cfg.train.save_every == 0) or step == cfg.train.steps:
                save_checkpoint(run, out, step, cfg.train.keep_last)
            if stop:
                log.info("stop signal received: checkpoint of step %d saved; exiting", step)
                return 0
    except KeyboardInterrupt as e:
        log.warning("%s", e or "stopped at once")
        return 130
    finally:
        progress.close()
        sinks.close()
        if hasattr(run.weight_sync, "close"):
            run.weight_sync.close()  # leave the nccl update group before its servers stop
        if run.engine is not None and hasattr(run.engine, "close"):
            run.engine.close()
        if servers is not None:
            servers.stop()
    if dpo:
        run.policy.export_hf(out / "hf")  # the trained policy as a HF checkpoint (collective)
    if rank == 0:
        figures = write_report(out)
        log.info("report: %s", ", ".join(str(f) for f in figures))
    return 0


def _step_state(run: Any) -> dict[str, Any]:
    """What a step changes before its rollout returns (the prompt draws), to undo when it fails."""
    return copy.deepcopy({"sampler": run.sampler.state_dict(),
                          "rewards": run.rewards.state_dict() if run.rewards is not None else None})


def _save_and_give_up(run: Any, out: Path, last: int, before: dict[str, Any], cfg: RunConfig, log: Any,
                      error: Exception) -> int:
    """No rollout server recovered: checkpoint step `last` as it ended (draws undone), exit 3."""
    run.sampler.load_state_dict(before["sampler"])
    if before["rewards"] is not None:
        run.rewards.load_state_dict(before["rewards"])
    done = latest_checkpoint(out)
    if last >= 1 and (done is None or done.name != f"step_{last:06d}"):
        save_checkpoint(run, out, last, cfg.train.keep_last)
    log.error("no rollout server answered within rollout.timeout_s=%g s (%s); checkpoint of step %d saved, "
              "resume with train.resume=auto once the servers are back", cfg.rollout.timeout_s, error, last)
    return EXIT_NO_SERVER


def _agree(flag: bool) -> bool:
    """True on every rank when any rank saw the flag (a signal may reach one rank first)."""
    if not dist.is_initialized():
        return flag
    from moe_rl.devices import compute_device

    t = torch.tensor([1 if flag else 0], device=compute_device())  # NCCL groups take device tensors
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def build_run(cfg: RunConfig, out: Path, rank: int) -> dict[str, Any]:
    """Model checkpoint, policy, data, rewards, rollout engine and weight sync for this rank."""
    from moe_rl.collectives import init_control_group
    from moe_rl.config import handoff_timeout_s
    from moe_rl.data.dataset import load_dataset
    from moe_rl.data.sampler import PromptSampler
    from moe_rl.loop import Run
    from moe_rl.reward.registry import get_reward
    from moe_rl.reward.runner import RewardRunner
    from moe_rl.rollout.weight_sync import make_weight_sync

    dataset = load_dataset(cfg.data.train, _hf_tokenizer(cfg), cfg.data.prompt_key, cfg.data.answer_key,
                           cfg.data.max_prompt_len)
    runner = RewardRunner(get_reward(cfg.reward.name, data=cfg.data.train), cfg.reward.max_failure_frac)
    if getattr(dataset.tokenizer, "decode", None) is None and not runner.reads_ids:
        raise ConfigError(f"reward.name={cfg.reward.name!r} reads only the completion text, but {cfg.data.train} "
                          "comes without a tokenizer to decode completions with: set model.hf_path to a checkpoint "
                          "with tokenizer files, or use a reward with a completion_ids parameter")
    hf_dir = initial_model(cfg, out, rank, dataset)
    policy = make_policy(cfg, hf_dir, cfg.algo.num_minibatches, temperature=cfg.rollout.temperature)
    init_control_group(handoff_timeout_s(cfg))  # from here on, waits for rank 0 cannot time out first
    eos = getattr(dataset.tokenizer, "eos_token_id", None)
    if eos is None:
        eos = policy.hf_config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    sampler = PromptSampler(len(dataset), cfg.data.prompts_per_step, seed=cfg.data.shuffle_seed)
    engine, servers = (start_engine(cfg, hf_dir, out, policy) if rank == 0 else (None, None))
    sync = make_weight_sync(cfg, root=out / "weights", keep_last=2, keys=getattr(engine, "keys", None),
                            **(update_group(cfg, servers, out) if cfg.rollout.weight_sync == "nccl" else {}))
    run = Run(cfg=cfg, policy=policy, dataset=dataset, sampler=sampler, rewards=runner, engine=engine,
              weight_sync=sync, eos_id=int(eos) if eos is not None else -1, rank=rank,
              critic=build_critic(cfg, policy.spec) if cfg.algo.advantage == "gae" else None)
    eval_set = load_dataset(cfg.data.eval, _hf_tokenizer(cfg), cfg.data.prompt_key, cfg.data.answer_key,
                            cfg.data.max_prompt_len) if cfg.data.eval and cfg.train.eval_every else None
    return {"run": run, "eval": eval_set, "servers": servers}


def make_policy(cfg: RunConfig, hf_dir: Path, updates_per_step: int, temperature: float = 1.0) -> Any:
    """The megatron policy of `hf_dir` in the configured layout, optimizer and LR schedule; its
    log-probs are of softmax(logits / `temperature`) (RL: the rollout's sampling temperature)."""
    from moe_rl.policy.parallel import ParallelLayout, read_dist_env
    from moe_rl.policy.policy import Policy, PolicySpec

    p = cfg.parallel
    layout = ParallelLayout(tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, etp=p.etp, sp=p.sp,
                            world_size=read_dist_env().world_size)
    return Policy(PolicySpec(str(hf_dir), layout, optim_config(cfg, updates_per_step), cfg.model.dtype,
                             cfg.model.recompute, p.micro_batch_size, cfg.model.seed, p.max_tokens_per_microbatch,
                             temperature=temperature, moe_aux_loss_coef=cfg.model.moe_aux_loss_coef,
                             collective_timeout_s=cfg.train.collective_timeout_s, perf=perf_request(cfg)))


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


def _hf_tokenizer(cfg: RunConfig) -> Any:
    if not cfg.model.hf_path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(cfg.model.hf_path)
    except Exception:  # id-only checkpoints (no tokenizer files) are fine for id datasets
        return None


def initial_model(cfg: RunConfig, out: Path, rank: int, dataset: Any) -> Path:
    """`model.hf_path`, or a fresh tiny Qwen3-MoE written by rank 0 into the run directory."""
    if cfg.model.hf_path:
        return Path(cfg.model.hf_path)
    path = out / "init_model"
    if rank == 0 and not (path / "config.json").is_file():
        from moe_rl.policy.tiny import TinyMoEConfig, make_tiny_qwen3_moe

        tok = dataset.tokenizer
        shape = asdict(cfg.model.tiny)
        init_std = shape.pop("init_std")
        tiny = TinyMoEConfig(**shape)
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tok, attr, None) is not None:
                setattr(tiny, attr, int(getattr(tok, attr)))
        make_tiny_qwen3_moe(path.with_suffix(".tmp"), seed=cfg.model.seed, config=tiny, init_std=init_std)
        os.replace(path.with_suffix(".tmp"), path)
    if dist.is_initialized():
        dist.barrier()
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
                 "master_port": r.weight_sync_port or _free_port(avoid=int(os.environ.get("MASTER_PORT", "0"))),
                 "server_tp_sizes": r.server_tp_size if r.engine == "sglang" else 1,
                 # the group joined last, left by a trainer that died without leaving it
                 "state_file": None if out is None else str(out / "servers" / "update_group.json"),
                 "backend": "nccl" if torch.cuda.is_available() else "gloo"}
    from moe_rl.collectives import broadcast_object

    return broadcast_object(found)  # the others wait while rank 0 starts the servers


def _free_port(avoid: int) -> int:
    """A TCP port free on every interface of this host (the servers connect from other nodes)."""
    import socket

    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        if port != avoid:
            return port


def start_engine(cfg: RunConfig, hf_dir: Path, out: Path, policy: Any) -> tuple[Any, Any]:
    """Rank 0: connect to `rollout.urls`, or start servers and connect; (client, server group or None)."""
    from moe_rl.devices import gpu_count, local_trainer_ranks
    from moe_rl.rollout.auth import read_key_file
    from moe_rl.rollout.launcher import RunIdentity, ServerGroup
    from moe_rl.rollout.placement import server_gpus
    from moe_rl.rollout.sglang_client import SGLangClient

    if cfg.rollout.engine == "inprocess":  # no server: the engine runs in this process
        from moe_rl.rollout.inprocess import inprocess_engine

        return inprocess_engine(cfg, hf_dir), None
    arch = policy.arch
    servers = None
    r = cfg.rollout
    urls, admin = list(r.urls), list(r.admin_urls) or None
    keys, served_name = (read_key_file(r.api_key_file) if r.api_key_file else None), r.served_model_name
    if not urls:  # launched here: fresh run id (and keys off loopback), supervised, weights only from ours
        # weights only from ours: the versions synced and the checkpoint they started from (reloaded
        # after a colocated release, which loses them)
        identity = RunIdentity.for_run(out, r.host, trusted_dirs=[out / "weights", hf_dir])
        gpus = server_gpus(r, local_trainer_ranks(cfg.train.world_size), gpu_count())  # after the trainer's GPUs
        servers = ServerGroup.from_config(r, hf_dir, out / "servers", identity=identity, gpus=gpus).start()
        if r.weight_sync == "nccl":  # a restarted server could not rejoin the update group: it would serve stale weights
            servers.max_restarts = 0
        servers.wait_healthy(timeout=r.timeout_s)
        servers.watch()
        urls, admin, keys, served_name = servers.urls, servers.admin_urls, identity.keys, identity.run_id
    client = SGLangClient(urls, admin_urls=admin, max_concurrency=cfg.rollout.concurrency,
                          keys=keys, served_name=served_name, no_server_timeout=r.timeout_s,
                          request_timeout=cfg.rollout.timeout_s, max_attempts=cfg.rollout.retries + 1,
                          num_layers=arch.num_layers, topk=arch.moe_router_topk,
                          num_experts=arch.num_moe_experts, moe_layer_ids=list(arch.moe_layers),
                          initial_weights=hf_dir)
    return client, servers


# ---------------------------------------------------------------- checkpoints

def save_checkpoint(run: Any, out: Path, step: int, keep_last: int) -> Path:
    """Every rank writes its state into `step_N.tmp/`; rank 0 renames it to `step_N/` once all are done.

    A crash while writing leaves only a `.tmp` directory, which resume ignores. `meta.json`
    records every file's size and SHA-256 (`moe_rl.integrity`), so damage is found on resume.
    """
    root = out / CHECKPOINTS
    final = root / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if run.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    state = {"policy": run.policy.state_dict(), "critic": run.critic.state_dict() if getattr(run, "critic", None) else None,
             "sampler": run.sampler.state_dict(),
             "rewards": run.rewards.state_dict() if run.rewards is not None else None,  # None in DPO runs
             "step": step, "weight_version": run.weight_version, "drift_state": run.drift_state, "rng": _rng_state()}
    mine = f"rank_{run.rank:05d}.pt"
    torch.save(state, tmp / mine)
    records = _all_gather((mine, file_record(tmp / mine)))  # each rank hashes its own file
    if run.rank == 0:
        meta = {"step": step, "world_size": _world(), "files": dict(records)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def latest_checkpoint(out: Path) -> Path | None:
    """The newest finished checkpoint (its meta.json written), intact or not."""
    done = sorted(p for p in (out / CHECKPOINTS).glob("step_*") if (p / "meta.json").is_file())
    return done[-1] if done else None


def intact_checkpoint(out: Path, rank: int, log: Any) -> Path | None:
    """The newest finished checkpoint whose files all match their records (collective: every
    rank checks its own file and they agree); damaged ones are named and skipped."""
    done = sorted((p for p in (out / CHECKPOINTS).glob("step_*") if (p / "meta.json").is_file()), reverse=True)
    for path in done:
        problem = _agreed_problem(path, rank)
        if not problem:
            return path
        log.warning("skipping damaged checkpoint %s: %s", path, problem)
    return None


def _agreed_problem(path: Path, rank: int) -> str:
    """What is wrong with checkpoint `path` as any rank sees it ("" when every rank finds it intact)."""
    meta, problem = read_meta(path)
    if meta is not None:
        problem = check_file(path, f"rank_{rank:05d}.pt", meta)
    problems = [p for p in _all_gather(problem or "") if p]
    return "; ".join(dict.fromkeys(problems))


def resume(run: Any, cfg: RunConfig, out: Path, log: Any) -> int:
    """Load the checkpoint `train.resume` names (or with "auto" the newest intact one, skipping
    damaged ones with a warning that names the file); returns its step (0 if none)."""
    if not cfg.train.resume:
        return 0
    path = intact_checkpoint(out, run.rank, log) if cfg.train.resume == "auto" else Path(cfg.train.resume)
    if path is None:
        log.info("no intact checkpoint in %s: starting from step 1", out / CHECKPOINTS)
        return 0
    problem = _agreed_problem(path, run.rank)
    if problem:
        raise RuntimeError(f"cannot resume from {path}: {problem}")
    meta = read_meta(path)[0]
    if meta["world_size"] != _world():
        raise RuntimeError(f"{path} was written by {meta['world_size']} ranks; this run has {_world()} "
                           f"(resume with the same layout)")
    file = path / f"rank_{run.rank:05d}.pt"
    try:
        state = torch.load(file, weights_only=False)
    except Exception as e:  # a file that matches its record but will not load: say which
        raise RuntimeError(f"cannot load {file}: {type(e).__name__}: {e}") from e
    run.policy.load_state_dict(state["policy"])
    if run.critic is not None:
        if state.get("critic") is None:
            raise RuntimeError(f"{path} holds no critic: it was saved by a run without algo.advantage=gae")
        run.critic.load_state_dict(state["critic"])
    run.sampler.load_state_dict(state["sampler"])
    if run.rewards is not None:  # DPO runs have no reward runner
        run.rewards.load_state_dict(state["rewards"])
    run.weight_version = state["weight_version"]
    run.drift_state = state["drift_state"]
    _set_rng_state(state["rng"])
    if run.weight_sync is not None:
        from moe_rl.loop import sync_weights

        sync_weights(run)  # the engine starts from the initial weights: give it the resumed ones
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (on the control group: rank 0 may come from starting servers)."""
    from moe_rl.collectives import all_gather_objects

    return all_gather_objects(obj)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
