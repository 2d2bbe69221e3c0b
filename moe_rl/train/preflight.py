"""Checks `moe-rl train` runs before any rank starts: mistakes that would otherwise surface
minutes later as one traceback per rank.

Each check returns one line naming the field or `file:line` and what to do, or None. The
config itself was validated when it was loaded (`moe_rl.config`); what is checked here needs
the files it names: the checkpoint's shape against the layout and world size, the resume
checkpoint, the data files and their token ids against the vocabulary.
"""
from __future__ import annotations

from pathlib import Path

from moe_rl.config import RunConfig
from moe_rl.recipes.build import run_tokenizer
from moe_rl.train.model_shape import model_shape, run_hf_config


def preflight(cfg: RunConfig, world_size: int) -> str | None:
    """The first problem that would stop this run, or None."""
    for check in (_model, lambda c: _layout(c, world_size), _resume, _data, _reward, _keys, _devices,
                  _in_place_servers):
        problem = check(cfg)
        if problem:
            return problem
    return None


def _model(cfg: RunConfig) -> str | None:
    if cfg.model.hf_path and not (Path(cfg.model.hf_path) / "config.json").is_file():
        return (f"model.hf_path: {cfg.model.hf_path} has no config.json; give a HF checkpoint directory "
                "(or leave model.hf_path unset for a fresh tiny model)")
    return None


def _layout(cfg: RunConfig, world_size: int) -> str | None:
    from moe_rl.policy.model import arch_from_hf_dict
    from moe_rl.policy.parallel import LayoutError, ParallelLayout

    layout = ParallelLayout.of(cfg.parallel, world_size)
    try:
        layout.validate(arch_from_hf_dict(run_hf_config(cfg), cfg.model.hf_path or "model.tiny"))
    except LayoutError as e:
        return f"parallel / train.world_size={world_size}: {e}"
    except Exception as e:  # noqa: BLE001 - an unsupported architecture says so itself
        return f"model: {e}"
    return None


def _resume(cfg: RunConfig) -> str | None:
    from moe_rl.train.checkpoint import latest_checkpoint
    from moe_rl.train.integrity import not_a_checkpoint, read_meta

    r = cfg.train.resume
    if r and r != "auto" and (why := not_a_checkpoint(Path(r))):
        return f"train.resume: {why}; give a checkpoints/step_N directory or train.resume=auto"
    path = latest_checkpoint(Path(cfg.log.run_dir)) if r == "auto" and cfg.log.run_dir else Path(r) if r else None
    if path is None:
        return None
    meta, _ = read_meta(path)
    if meta is None:
        return None  # an unreadable meta.json is resume's to report, with the file named
    saved, ours = meta.get("model") or {}, model_shape(cfg)
    for key in saved:
        if key in ours and ours[key] != saved[key]:
            return (f"train.resume: {path} holds a model with {key}={saved[key]}, this run's model has "
                    f"{key}={ours[key]} (model.hf_path / model.tiny); resume with the checkpoint's model, or "
                    "start a new run directory")
    return None


def _reward(cfg: RunConfig) -> str | None:
    """The reward imports and exists (a user's `module:function` is imported here, once, as each
    rank will import it): otherwise every rank fails after it started, one traceback each."""
    from moe_rl.reward.registry import get_reward

    if cfg.train.mode != "rl":
        return None
    try:
        get_reward(cfg.reward.name, data=cfg.data.train)
    except (KeyError, ImportError) as e:
        return f"reward.name: {' '.join(str(e.args[0] if e.args else e).split())}"
    return None


def _data(cfg: RunConfig) -> str | None:
    from moe_rl.data.dataset import DataError, load_dataset
    from moe_rl.data.preference import load_preference_dataset

    vocab = int(run_hf_config(cfg)["vocab_size"])
    tok = run_tokenizer(cfg)
    for key, spec in (("data.train", cfg.data.train), ("data.eval", cfg.data.eval if cfg.train.eval_every else None)):
        if not spec:
            continue
        try:
            if cfg.train.mode == "dpo":  # preference pairs: every token of both responses counts
                data = load_preference_dataset(spec, tok, cfg.dpo.max_len)
                ids = [(p.uid, p.prompt_ids + p.chosen_ids + p.rejected_ids) for p in data]
            else:
                data = load_dataset(spec, tok, cfg.data.prompt_key, cfg.data.answer_key, cfg.data.max_prompt_len)
                ids = [(p.uid, p.prompt_ids) for p in data]
        except (DataError, OSError, ValueError) as e:
            return f"{key}: {e}"
        for uid, row in ids:
            bad = [t for t in row if not 0 <= t < vocab]
            if bad:
                return (f"{key}: row {uid} has token id {bad[0]} outside the model's vocabulary "
                        f"[0, {vocab}); the data was tokenized for another model")
    return None


def _keys(cfg: RunConfig) -> str | None:
    """rollout.api_key_file must be readable and hold the keys (moe_rl/rollout/auth.py)."""
    path = getattr(cfg.rollout, "api_key_file", None)
    if not path or cfg.train.mode == "dpo":
        return None
    from moe_rl.rollout.auth import read_key_file

    try:
        read_key_file(path)
    except ValueError as e:
        return f"rollout.api_key_file: {e}"
    return None


def _devices(cfg: RunConfig, device_count: int | None = None) -> str | None:
    """Servers the trainer launches here must fit this machine's GPUs beside the trainer ranks'."""
    from moe_rl.dist.devices import gpu_count, local_trainer_ranks
    from moe_rl.rollout.placement import server_gpus

    if cfg.train.mode == "dpo":
        return None
    try:
        server_gpus(cfg.rollout, local_trainer_ranks(cfg.train.world_size),
                    gpu_count() if device_count is None else device_count)
    except ValueError as e:
        return str(e)
    return None


def _in_place_servers(cfg: RunConfig) -> str | None:
    """Servers this run did not start (rollout.urls) must keep no prefix cache when pushes land in place
    (rollout.inflight_update=in_place): such a push flushes none, so a cached prompt would keep the KV and
    routes of old weights for the rest of the run. The servers the run launches get --disable-radix-cache.
    A server that does not answer yet is left to the run's own health checks."""
    from moe_rl.rollout.config import in_place_refusal, pushes_in_place

    r = cfg.rollout
    if cfg.train.mode == "dpo" or not r.urls or not pushes_in_place(r):
        return None
    from moe_rl.rollout.auth import read_key_file
    from moe_rl.rollout.sglang_client import SGLangClient

    keys = read_key_file(r.api_key_file) if r.api_key_file else None
    with SGLangClient(list(r.urls), admin_urls=list(r.admin_urls) or None, keys=keys, probe_timeout=10.0,
                      max_attempts=1) as client:
        for url, info in client.server_infos().items():
            problem = in_place_refusal(r, url, info)
            if problem:
                return problem
    return None
