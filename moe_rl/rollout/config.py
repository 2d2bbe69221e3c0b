"""The `rollout` section of the run config: engine, servers, sampling, weight sync, and its rules.

The `check_*(cfg)` rules take the whole `RunConfig` (`moe_rl.config`, which imports this
module: hence `Any`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence
from urllib.parse import urlsplit

from moe_rl.algo.config import staleness_bound
from moe_rl.configurable import ConfigError, choice, ranged
from moe_rl.rollout.auth import LOOPBACK_HOSTS
from moe_rl.rollout.engines import ENGINE_KINDS, WEIGHT_SYNC_KINDS, engine_kind, weight_sync_kind


ENGINES = tuple(ENGINE_KINDS)  # local, sglang, inprocess (moe_rl/rollout/engines.py)
WEIGHT_SYNCS = tuple(WEIGHT_SYNC_KINDS)  # disk, tensor, nccl (moe_rl/rollout/engines.py)
INFLIGHT_UPDATES = ("auto", "wait", "in_place", "retract")


def pause_mode(rollout: Any, max_staleness: int) -> str | None:
    """The /pause_generation mode a weight push pauses the generating requests with
    (`rollout.inflight_update`): "in_place" or "retract"; None when the push waits for them.

    auto: wait when the run is synchronous (nothing generates during a push), retract when it is
    asynchronous. Measured on the demo model (K = 2, 8-token answers, 15% of samples spanning a
    push): the tokens generated after an in-place push have a 16x larger engine/trainer log-prob
    mismatch than retracted ones (0.0032 vs 0.0002) and 4x the route mismatch, for no measurable
    step time; a retract costs one prefill of each paused sample per push."""
    mode = getattr(rollout, "inflight_update", "wait")
    if mode == "auto":
        mode = "retract" if max_staleness else "wait"
    return None if mode == "wait" else mode


def pushes_in_place(rollout: Any) -> bool:
    """Whether a weight push pauses the generating requests in place: they keep their KV cache, so it
    asks for no cache flush, which SGLang refuses under running requests (a retract frees them first)."""
    return getattr(rollout, "inflight_update", "wait") == "in_place"


def in_place_refusal(rollout: Any, url: str, server_info: Any) -> str | None:
    """Why a run that pushes in place must not use the running server at `url` (rollout.urls): its /server_info
    does not say `disable_radix_cache: true`. The servers this run launches get --disable-radix-cache
    (launcher.radix_cache_args); one started by someone else may keep a prefix cache, which an in-place
    push never flushes. None: fine (or the run does not push in place)."""
    if not pushes_in_place(rollout) or (isinstance(server_info, dict) and server_info.get("disable_radix_cache") is True):
        return None
    return (f"rollout.inflight_update=in_place: the server {url} keeps a prefix cache (its /server_info has no "
            "disable_radix_cache: true) and an in-place push flushes none, so cached prompts would keep the KV and "
            "routes of old weights for the rest of the run; restart it with --disable-radix-cache, or set "
            "rollout.inflight_update=retract")


# SGLang 0.5.23's names of its parallel sizes (sglang/srt/arg_groups/fields/parallel.py; argparse
# also takes an unambiguous prefix such as --tp).
SGLANG_TP_FLAGS = ("--tp-size", "--tensor-parallel-size", "--tp")
SGLANG_DP_FLAGS = ("--dp-size", "--data-parallel-size", "--dp")
SGLANG_PP_FLAGS = ("--pp-size", "--pipeline-parallel-size", "--pp")


def sglang_flag(args: Sequence[Any], flags: Sequence[str]) -> str | None:
    """The value the last of `flags` gets in `args` (`--flag N` or `--flag=N`), as SGLang's parser
    reads it; None when none of them is there."""
    args = [str(a) for a in args]
    found = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in flags:
            found = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    return found


@dataclass
class RolloutConfig:
    """How responses are generated: engine, servers and sampling."""

    engine: str = choice("local", ENGINES)
    """local = HF-transformers engine (CPU, speaks SGLang's HTTP API); sglang = real SGLang servers;
    inprocess = the HF-transformers engine inside trainer rank 0 (no server, no HTTP; small CPU runs)."""
    urls: list[str] = field(default_factory=list)
    """Base URLs of servers that are already running; empty means launch `num_servers` ourselves."""
    colocated: bool = False
    """SGLang shares the trainer's GPUs: it releases its memory after each rollout and takes
    it back before the next rollout or weight update (servers need --enable-memory-saver).
    With engine=local the `moe-rl serve` processes track the same released/resumed state
    (the CPU rehearsal of the protocol)."""
    admin_urls: list[str] = field(default_factory=list)
    """With `urls` pointing at an sglang-router: the workers behind it. They get the weight
    updates, and the generate requests that ask for routed experts (the router drops them)."""
    num_servers: int = ranged(1, ge=1)
    """Servers to launch when `urls` is empty."""
    router: bool | None = None
    """sglang-router in front of the launched servers. None = auto (sglang engine with more
    than one server); true also puts it in front of `moe-rl serve` workers (the CPU rehearsal)."""
    n_samples: int = ranged(8, ge=2)
    """Responses per prompt (G); group advantages need at least 2. 8 as in the GSPO/DAPO setups."""
    temperature: float = ranged(1.0, gt=0.0)
    """Sampling temperature T. The trainer trains the distribution sampled from: every
    log-prob (engine, old pass, updates, drift) is log_softmax(logits / T). 1.0 = the model's own."""
    top_p: float = ranged(1.0, gt=0.0, le=1.0)
    """Nucleus sampling; 1.0 (off). < 1 needs `allow_truncated_sampling` (see there)."""
    top_k: int = -1
    """Top-k sampling; -1 (off). >= 1 needs `allow_truncated_sampling` (see there)."""
    allow_truncated_sampling: bool = False
    """Accept top_p < 1 or top_k >= 1. The engine then samples from a truncated distribution
    whose log-probs neither it (SGLang returns them before truncation) nor the trainer
    reproduce, so the update is silently off-policy; true says you accept that."""
    max_new_tokens: int = ranged(64, ge=1)
    """Response length cap; 64 fits the toy tasks. In a multi-turn episode, the cap of each model turn."""
    env: str | None = None
    """Multi-turn rollouts: the environment each sample is an episode with (moe_rl/env/): a built-in
    (`calculator`, `guess`) or your own class as `module:Class`; None = one completion per prompt,
    scored by `reward.name`."""
    max_turns: int = ranged(4, ge=1)
    """With `env`: the most model turns per episode."""
    max_episode_tokens: int = ranged(64, ge=1)
    """With `env`: the most tokens after the prompt per episode, the model's and the environment's."""
    episode_reward: str = choice("sum", ("sum", "last"))
    """With `env`: an episode's reward from its turns' rewards: sum = all of them (per-turn shaping
    included); last = the last turn's alone (the outcome, e.g. the answer without a tool-call bonus)."""
    concurrency: int = ranged(64, ge=1)
    """Requests in flight across all servers; bounds client memory and server queueing."""
    intake: str = choice("auto", ("rank0", "heads", "auto"))
    """Which trainer ranks receive the step's samples from the servers. heads = rank 0 draws the
    prompt groups and each data-parallel head (the first rank of each model-parallel group) asks for,
    receives and scores its own, so a step's bytes arrive spread over the heads
    (`rollout.concurrency` is split over them); rank0 = trainer rank 0 receives, scores and plans the
    whole step and hands each data-parallel rank its share. The same samples either way. heads needs
    servers the heads can reach (engine local or sglang, rollout.colocated=false); auto = heads
    where every head reaches the servers, else rank0."""
    timeout_s: float = ranged(120.0, gt=0.0)
    """Per-request HTTP timeout in seconds."""
    retries: int = ranged(3, ge=0)
    """Retries per failed request before the step fails."""
    host: str = "127.0.0.1"
    """Interface launched servers bind to; loopback unless servers run on other nodes."""
    base_port: int | None = ranged(None, ge=1, le=65535)
    """Port of the first launched server; server i uses base_port + i. None = consecutive ports
    found free at launch (two runs on one machine never collide); SLURM jobs use 30000."""
    sglang_args: list[str] = field(default_factory=list)
    """Extra command-line arguments passed to `sglang.launch_server` as given. A --tp-size here
    wins over `tp_size` (it comes last on SGLang's command line), and the weight sync and GPU
    placement follow it."""
    tp_size: int = ranged(1, ge=1)
    """--tp-size of each SGLang server (unless sglang_args gives one)."""
    ep_size: int = ranged(1, ge=1)
    """--ep-size of each SGLang server; must divide tp_size."""
    mem_fraction: float = ranged(0.8, gt=0.0, le=1.0)
    """Share of GPU memory SGLang may take for weights + KV cache (its --mem-fraction-static)."""
    weight_sync: str = choice("disk", WEIGHT_SYNCS)
    """How new weights reach the engine: disk (safetensors; works everywhere), tensor (same
    process), nccl (every trainer rank that owns HF tensors sends its own share to every server,
    bucket by bucket, over a process group it forms with each: NCCL on GPUs, gloo to `moe-rl serve`
    on CPU)."""
    weight_sync_delta: bool = False
    """nccl: after a full push, send only what changed in the dtype the servers hold (unchanged
    tensors are skipped; `moe-rl serve` also takes the changed elements alone). A failed push or a
    restarted server makes the next push full."""
    verify_weights: bool = True
    """nccl: after each push compare every server's checksums (/weights_checker) with what was sent,
    and stop naming the tensor and the server on a mismatch."""
    inflight_update: str = choice("auto", INFLIGHT_UPDATES)
    """What a weight push does to the requests still generating (with algo.max_staleness >= 1, the
    next steps'): auto = wait for a synchronous run, retract for an asynchronous one (the measured
    choice: see resolve_inflight_update); wait = SGLang's default, the push waits for them to finish
    (so the trainer waits for its prefetch first); in_place = pause them in place (/pause_generation), push without a
    cache flush (SGLang refuses one under paused requests), continue: they finish under the new
    weights (partial rollouts), their tokens spanning two versions (rollout/partial_frac), and
    the trainer does not wait; the tokens after the push attend to keys and values the old
    weights computed. retract = the same, but the paused requests give up their KV cache and
    are prefilled again (prompt and output so far) under the new weights: their later tokens are
    exactly the new version's and all their routes are, at the cost of one prefill per push."""
    weight_sync_port: int | None = ranged(None, ge=1, le=65535)
    """nccl: port on trainer rank 0 (MASTER_ADDR) where the servers join the weight update group;
    None = a free port picked at start (set it when a firewall allows only fixed ports)."""
    return_routed_experts: bool = True
    """Ask the engine for its routed experts; needed for R3 and train-rollout mismatch metrics."""
    api_key_file: str | None = None
    """With `urls`: the servers' keys, a file of 'api-key: KEY' and 'admin-api-key: KEY' lines
    (mode 600; the file SGLang and `moe-rl serve` read with --config). Launched servers on a
    non-loopback `host` get fresh per-run keys instead; on loopback they stay keyless."""
    served_model_name: str | None = None
    """With `urls`: the --served-model-name the servers run under; a server reporting another
    name in /server_info is refused. None = not checked (launched servers always are)."""
    max_restarts: int = ranged(3, ge=0)
    """Launched servers: how often each one that dies is restarted (same port, same argv; not with
    weight_sync=nccl, where a new server cannot join the update group and would serve stale weights)."""

    @property
    def server_tp_size(self) -> int:
        """Each SGLang server's tensor-parallel size: the last --tp-size of `sglang_args`, else `tp_size`."""
        value = sglang_flag(self.sglang_args, SGLANG_TP_FLAGS)
        return self.tp_size if value is None else int(value)


def heads_reach_servers(rollout: Any) -> bool:
    """Whether every data-parallel head can be a client of the servers: they are servers (not the
    in-process engine), and not colocated ones (rank 0 releases them after its rollout)."""
    return engine_kind(rollout).runs_as_servers and not rollout.colocated


def intake_on_heads(rollout: Any, urls: Sequence[str] = (), hosts: Sequence[str] = ()) -> bool:
    """`rollout.intake` resolved, the same on every rank (`urls`: the servers rank 0 reaches, `hosts`:
    every trainer rank's host): True when each data-parallel head receives its own samples. auto =
    heads unless some head cannot reach the servers (in-process, colocated, or listening on loopback
    while the trainer spans hosts); heads there is an error naming the fix."""
    if rollout.intake == "rank0" or not heads_reach_servers(rollout):
        return False
    if urls and all(urlsplit(u).hostname in LOOPBACK_HOSTS for u in urls) and len(set(hosts)) > 1:
        if rollout.intake == "heads":
            raise ConfigError(f"rollout.intake: 'heads' needs servers every data-parallel head can reach, but they "
                              f"listen on loopback ({urls[0]}) and the trainer spans {len(set(hosts))} hosts: set "
                              "rollout.host to an address the other nodes reach, or rollout.intake=rank0")
        return False
    return True


def check_rollout(cfg: Any) -> Iterator[str]:
    r = cfg.rollout
    if r.top_k == 0 or r.top_k < -1:
        yield f"rollout.top_k: {r.top_k} must be -1 (off) or >= 1"
    elif (r.top_p < 1.0 or r.top_k >= 1) and not r.allow_truncated_sampling:
        yield (f"rollout.top_p={r.top_p} / rollout.top_k={r.top_k}: truncated sampling draws tokens from a "
               "distribution whose log-probs neither the engine nor the trainer compute, so every update would be "
               "off-policy without correction; use top_p=1.0 and top_k=-1, or set "
               "rollout.allow_truncated_sampling=true to accept the bias")
    for i, url in enumerate(r.urls):
        if not url.startswith(("http://", "https://")):
            yield f"rollout.urls[{i}]: {url!r} must start with http:// or https://"
    sync = weight_sync_kind(r)
    if r.colocated and sync.update_group:
        yield (f"rollout.weight_sync: {sync.name!r} is not allowed with rollout.colocated=true: trainer rank 0 and "
               "server 0 share GPU 0, and NCCL refuses two ranks on one GPU in a communicator; use "
               "rollout.weight_sync=disk (colocated runs elsewhere send tensors by CUDA IPC, "
               "update_weights_from_tensor, which moe_rl does not do yet)")
    k = staleness_bound(cfg.algo)
    if r.inflight_update in ("in_place", "retract") and not k:
        yield (f"rollout.inflight_update: {r.inflight_update!r} needs algo.max_staleness >= 1: without it no "
               "request is generating when the weights are pushed")
    if r.colocated and k:
        yield (f"rollout.colocated: true is not allowed with algo.max_staleness={k} (or algo.off_policy_overlap="
               "true): colocated servers release their GPU memory while the trainer trains, so they cannot "
               "generate meanwhile; set algo.max_staleness=0")
    if r.intake == "heads" and not heads_reach_servers(r):
        yield (f"rollout.intake: 'heads' needs rollout servers the heads can reach, not "
               f"{'colocated ones (released by rank 0 after its rollout)' if r.colocated else 'an in-process engine'}"
               "; set rollout.intake=rank0")
    if r.router and r.urls:
        yield ("rollout.router: true starts a router in front of launched servers; rollout.urls is set (servers "
               "already run): put the router's URL in rollout.urls and its workers in rollout.admin_urls")
    sizes = {}
    for what, flags in (("tp", SGLANG_TP_FLAGS), ("dp", SGLANG_DP_FLAGS), ("pp", SGLANG_PP_FLAGS)):
        value = sglang_flag(r.sglang_args, flags)
        if value is not None and not (value.isdigit() and int(value) >= 1):
            yield f"rollout.sglang_args: {flags[0]} needs an integer >= 1, got {value!r}"
            return
        sizes[what] = 1 if value is None else int(value)
    tp = r.server_tp_size
    if tp % r.ep_size:
        yield f"rollout.ep_size: {r.ep_size} must divide the servers' tensor-parallel size {tp} (rollout.tp_size " \
              "or a --tp-size in rollout.sglang_args)"
    if sync.update_group and sizes["dp"] > 1:
        yield (f"rollout.sglang_args: --dp-size {sizes['dp']} is not allowed with rollout.weight_sync={sync.name}: SGLang "
               "refuses distributed weight updates to data-parallel replicas (it asserts dp_size == 1); run "
               "that many servers instead (rollout.num_servers), or use rollout.weight_sync=disk")
    if sync.update_group and sizes["pp"] > 1:
        yield (f"rollout.sglang_args: --pp-size {sizes['pp']} is not allowed with rollout.weight_sync={sync.name}: each "
               "server rank joins the update group as rank_offset + tp_rank, so pipeline stages would take the "
               "same ranks; use tensor parallelism (rollout.tp_size), or rollout.weight_sync=disk")
    kind = engine_kind(r)
    if r.weight_sync not in kind.weight_syncs:
        yield _UNREACHABLE.get(r.weight_sync, f"rollout.weight_sync: {r.weight_sync!r} cannot reach {kind.what}: "
                               f"use {' or '.join(kind.weight_syncs)}")
    if r.urls and not kind.runs_as_servers:
        yield (f"rollout.urls: set, but rollout.engine={r.engine} generates inside the trainer; "
               "empty rollout.urls, or use rollout.engine=local/sglang to reach running servers")


# Why a weight sync cannot reach an engine that lacks it in its `weight_syncs` (rollout/engines.py).
_UNREACHABLE = {
    "tensor": ("rollout.weight_sync: 'tensor' copies into an engine in the trainer's own process, but a run's "
               "rollout servers (SGLang or `moe-rl serve`) are other processes: use disk or nccl, or "
               "rollout.engine=inprocess"),
    "nccl": ("rollout.weight_sync: 'nccl' broadcasts to server processes; rollout.engine=inprocess has none: "
             "use rollout.weight_sync=tensor (or disk)"),
}
