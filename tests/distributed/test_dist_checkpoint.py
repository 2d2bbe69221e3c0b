"""A megatron distributed checkpoint of the policy (`Policy.save_sharded`) loads under another layout
and world size (`Policy.load_sharded`), with nothing changed.

A 2-rank EP2 run with the distributed optimizer trains one update and saves. Runs of other layouts
(one rank; TP2 on two) load it, and every number comes back exactly: the weights and, in model
space, the Adam moments and fp32 main parameters, each gathered to HF names and full shapes by
the project's exporter (`iter_hf_tensors`), compared with `torch.equal` against what the saving
run held; the Adam step and the LR schedule's step too. A fresh policy differs from the saved
one, so the comparison would catch a load that did nothing.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from moe_rl.policy.dist_ckpt import load_sharded, save_sharded
from moe_rl.policy.parity import sample_sequences
from moe_rl.testing import run_ranks

STATES = ("exp_avg", "exp_avg_sq", "main_param")


def _policy(layout: str, hf_dir: str) -> Any:
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig

    optim = OptimConfig(lr=1e-3, total_steps=4, distributed_optimizer=True)
    return Policy(PolicySpec(hf_dir=hf_dir, layout=ParallelLayout.parse(layout), optim=optim, micro_batch_size=2))


def _model_space(policy: Any) -> dict[str, dict[Any, torch.Tensor]]:
    """Per model parameter (this rank's TP/EP slice, whole over DP): Adam moments and fp32 main
    parameter, read from the optimizer itself (megatron's DP gather), not from a checkpoint."""
    from moe_rl.policy.train_step import sub_optimizers

    out: dict[str, dict[Any, torch.Tensor]] = {k: {} for k in STATES}
    for opt in sub_optimizers(policy.opt.optimizer):
        world = opt.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
        for index, buffer in enumerate(opt.buffers):
            ((_, whole),) = world[index].items()
            for p, (start, end, _) in buffer.param_index_map.items():
                for key, name in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("main_param", "param")):
                    out[key][p] = whole[name][start:end].reshape(p.shape).clone()
    return out


@torch.no_grad()
def _hf_view(policy: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Weights and optimizer state as full HF-named tensors: each state is swapped into its
    parameter's `.data` and gathered as the weights are (TP/EP/PP shards joined)."""
    from moe_rl.policy.convert import iter_hf_tensors

    space = _model_space(policy)
    params = [p for c in policy.chunks for p in c.parameters()]
    out = {"weights": {n: t.clone() for n, t in policy.hf_tensors()}}
    for key in STATES:
        kept = [p.data for p in params]
        try:
            for p in params:
                p.data = space[key][p]
            out[key] = {n: t.clone() for n, t in iter_hf_tensors(policy.chunks, policy.arch)}
        finally:
            for p, data in zip(params, kept):
                p.data = data
    return out


def _steps(policy: Any) -> tuple[list[float], int]:
    from moe_rl.policy.train_step import sub_optimizers

    steps = {float(s["step"]) for o in sub_optimizers(policy.opt.optimizer) for s in o.optimizer.state.values()}
    return sorted(steps), policy.opt.scheduler.num_steps


def _save(hf_dir: str, ckpt: str, batch: list[torch.Tensor]) -> dict:
    policy = _policy("ep2", hf_dir)

    def loss(logp, mb):
        return -(logp.float() * mb.loss_mask).sum() / 100.0, {}

    policy.update(batch[policy.dp_rank::policy.dp_size], {}, loss)
    view, steps = _hf_view(policy), _steps(policy)
    policy.save_sharded(ckpt)
    # the trainer's log-probs of the whole batch (each DP rank its share, in order)
    logp = policy.logprobs(batch[policy.dp_rank::policy.dp_size]).logp
    return {"view": view, "steps": steps, "logp": logp, "rank": policy.dp_rank}


def _save_async(hf_dir: str, out: str, batch: list[torch.Tensor]) -> dict:
    """One update, an asynchronous checkpoint of it, and a second update while its writers run."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from moe_rl.config import load_config
    from moe_rl.train.checkpoint import Checkpoints

    policy = _policy("ep2", hf_dir)

    def loss(logp, mb):
        return -(logp.float() * mb.loss_mask).sum() / 100.0, {}

    mine = batch[policy.dp_rank::policy.dp_size]
    policy.update(mine, {}, loss)
    view = _hf_view(policy)
    recipe = SimpleNamespace(rank=dist.get_rank(), cfg=load_config(None, ["parallel.ep=2", "train.world_size=2"]),
                             models=lambda: {"policy": policy}, state_dict=dict)
    ckpts = Checkpoints(recipe, Path(out), keep_last=2, async_save=True)
    ckpts.save(1)
    final = Path(out) / "checkpoints" / "step_000001"
    before = final.exists()
    policy.update(mine, {}, loss)  # the step goes on: the parameters change under the writers
    changed = any(not torch.equal(t, view["weights"][n]) for n, t in policy.hf_tensors())
    polls = []  # per step-start poll: (its files are being hashed, the checkpoint is listed)
    while ckpts.writing is not None:
        ckpts.poll()
        polls.append((ckpts.hashing, final.exists()))
        time.sleep(0.02)
    ckpts.wait()
    return {"view": view, "listed_before_done": before, "changed": changed, "final": str(final), "polls": polls}


def test_an_async_save_keeps_its_steps_numbers_while_the_next_update_trains(tiny_hf_dir, tmp_path):
    # the checkpoint is listed (step_N/, meta.json) only once every rank's writers are done, and it
    # holds the weights and Adam state of its step, not the update that ran while it was written
    from moe_rl.train.checkpoint import latest_checkpoint
    from moe_rl.train.integrity import check_file, read_meta

    batch = sample_sequences(64, num=4, max_len=10, seed=0)
    results = run_ranks(_save_async, 2, str(tiny_hf_dir), str(tmp_path / "run"), batch, timeout=300)
    assert not any(r["listed_before_done"] for r in results) and all(r["changed"] for r in results)
    # the poll that finds the writers done only starts hashing (in a thread, off the step); a later
    # poll, once every rank's hashes are in, lists the checkpoint
    for r in results:
        assert (True, False) in r["polls"] and r["polls"][-1] == (False, True), r["polls"]
    final = Path(results[0]["final"])
    assert latest_checkpoint(final.parent.parent) == final
    meta = read_meta(final)[0]
    assert any(n.startswith("policy/") for n in meta["files"])
    assert not [p for p in (check_file(final, n, meta) for n in meta["files"]) if p]  # every byte down and hashed
    want = _merged(results, "view")
    got = _merged(run_ranks(_load, 1, "single", str(tiny_hf_dir), str(final / "policy"), timeout=300), "view")
    for part in ("weights", *STATES):
        unequal = [n for n in want[part] if not torch.equal(got[part][n], want[part][n])]
        assert not unequal, f"{part}: {unequal[:5]}"


def _load(layout: str, hf_dir: str, ckpt: str, resave: str | None = None) -> dict:
    policy = _policy(layout, hf_dir)
    fresh = {n: t.clone() for n, t in policy.hf_tensors()}
    policy.load_sharded(ckpt)
    if resave:
        policy.save_sharded(resave)
    return {"fresh": fresh, "view": _hf_view(policy), "steps": _steps(policy)}


def _merged(results: list[dict], key: str) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank's HF tensors of one job in one dict (each name comes from the rank that holds it)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for r in results:
        for part, tensors in r[key].items():
            out.setdefault(part, {}).update(tensors)
    return out


@pytest.fixture(scope="module")
def saved(tiny_hf_dir, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("dist_ckpt") / "policy")
    batch = sample_sequences(64, num=4, max_len=10, seed=0)
    results = run_ranks(_save, 2, str(tiny_hf_dir), ckpt, batch, timeout=300)
    logp = {r["rank"]: r["logp"] for r in results}
    return ckpt, _merged(results, "view"), results[0]["steps"], (batch, logp)


@pytest.mark.parametrize("layout,world", [("single", 1), ("tp2", 2)])
def test_an_ep2_checkpoint_loads_exactly_under_another_layout(saved, tiny_hf_dir, layout, world, tmp_path):
    ckpt, want, steps, _ = saved
    resave = str(tmp_path / "again") if layout == "tp2" else None
    results = run_ranks(_load, world, layout, str(tiny_hf_dir), ckpt, resave, timeout=300)
    got = _merged(results, "view")
    fresh = {n: t for r in results for n, t in r["fresh"].items()}
    assert any(not torch.equal(fresh[n], want["weights"][n]) for n in want["weights"])  # the load had work to do
    for part in ("weights", *STATES):
        assert set(got[part]) == set(want[part]), part
        unequal = [n for n in want[part] if not torch.equal(got[part][n], want[part][n])]
        assert not unequal, f"{part}: {unequal[:5]}"
    assert all(r["steps"] == steps for r in results) and steps == ([1.0], 1)
    if resave:  # saved again under TP2, it exports the same tensors as the EP2 original
        from safetensors.torch import load_file

        from moe_rl.train.export import export_policy

        a, b = (export_policy(Path(d), Path(tiny_hf_dir), tmp_path / name)
                for d, name in ((ckpt, "from_ep2"), (resave, "from_tp2")))
        ta, tb = ({k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()} for d in (a, b))
        assert set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_export_writes_the_trained_weights_and_transformers_gives_the_trainers_logprobs(saved, tiny_hf_dir, tmp_path):
    # one process reads the EP2 checkpoint; the HF model has the saved weights bit for bit, and its
    # forward the log-probs the trainer computed in its own layout (float reordering: 1e-5)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from moe_rl.train.export import export_policy

    ckpt, want, _, (batch, logp) = saved
    out = export_policy(Path(ckpt), Path(tiny_hf_dir), tmp_path / "hf")
    tensors = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(tensors) == set(want["weights"]) and all(torch.equal(tensors[k], want["weights"][k]) for k in tensors)
    probe = tmp_path / "probe"  # the weights are readable as any file this process writes (safetensors: 0600)
    probe.write_text("")
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in out.glob("*.safetensors")} == {
        f.name: oct(probe.stat().st_mode & 0o777) for f in out.glob("*.safetensors")}
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for rank, seqs in ((r, batch[r::2]) for r in (0, 1)):
        for i, seq in enumerate(seqs):
            with torch.no_grad():
                lp = torch.log_softmax(model(seq.view(1, -1)).logits[0].float(), -1)[:-1].gather(1, seq[1:].view(-1, 1))
            torch.testing.assert_close(lp.view(-1), logp[rank][i, : seq.numel() - 1], rtol=0, atol=1e-5)


# ---- each data-parallel rank writes and reads only its own range of the optimizer state

@contextmanager
def _no_dp_gather():
    """megatron's gather of the model shard's optimizer state over DP (`fully_reshardable` in
    megatron-core's own form) raises while this runs."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def refuse(*a, **k):
        raise AssertionError("the optimizer state was gathered over DP")

    kept = DistributedOptimizer.get_parameter_state_dp_zero
    DistributedOptimizer.get_parameter_state_dp_zero = refuse
    try:
        yield
    finally:
        DistributedOptimizer.get_parameter_state_dp_zero = kept


def _save_both(hf_dir: str, own: str, gathered: str, batch: list[torch.Tensor]) -> dict:
    policy = _policy("tp2-dp2", hf_dir)
    policy.update(batch[policy.dp_rank::policy.dp_size], {}, lambda logp, mb: (-(logp.float() * mb.loss_mask).sum() / 100.0, {}))
    view = _hf_view(policy)
    with _no_dp_gather():
        policy.save_sharded(own)
    save_sharded(policy, gathered, gathered=True)
    return {"view": view}


def _load_both(layout: str, hf_dir: str, own: str, gathered: str) -> dict:
    """The own-range checkpoint through the own-range loader (no gather), then, over a perturbed
    state, the gathered one through it too; and the own-range checkpoint through megatron's loader."""
    from moe_rl.policy.train_step import sub_optimizers

    policy = _policy(layout, hf_dir)
    fresh = {n: t.clone() for n, t in policy.hf_tensors()}
    with _no_dp_gather():
        policy.load_sharded(own)
    views = {"own": _hf_view(policy)}
    with torch.no_grad():  # so that the next loads have every number to restore
        for opt in sub_optimizers(policy.opt.optimizer):
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    p.add_(1.0)
                    for k in ("exp_avg", "exp_avg_sq"):
                        opt.optimizer.state[p][k].add_(1.0)
    with _no_dp_gather():
        policy.load_sharded(gathered)
    views["gathered"] = _hf_view(policy)
    load_sharded(policy, own, gathered=True)
    views["megatron_loader"] = _hf_view(policy)
    return {"fresh": fresh, "views": views}


@pytest.mark.parametrize("layout,world", [("ep2", 2)])
def test_each_dp_rank_saves_and_loads_its_own_range_exactly_and_both_formats_read_each_other(
        tiny_hf_dir, tmp_path, layout, world):
    # saved under tp2 x dp2 (the GLU halves split by TP: megatron's factories; experts on a
    # prepended axis, DP-sharded) without any rank gathering the optimizer over DP; loaded under
    # EP2 (dense dp2, experts edp1) without a gather, every weight, moment and fp32 main param exact
    own, gathered = str(tmp_path / "own"), str(tmp_path / "gathered")
    batch = sample_sequences(64, num=4, max_len=10, seed=0)
    want = _merged(run_ranks(_save_both, 4, str(tiny_hf_dir), own, gathered, batch, timeout=300), "view")
    from megatron.core.dist_checkpointing import load_content_metadata

    assert [load_content_metadata(d)["distrib_optim_ranges"] for d in (own, gathered)] == ["own", "gathered"]
    results = run_ranks(_load_both, world, layout, str(tiny_hf_dir), own, gathered, timeout=300)
    fresh = {n: t for r in results for n, t in r["fresh"].items()}
    assert any(not torch.equal(fresh[n], want["weights"][n]) for n in want["weights"])
    for how in ("own", "gathered", "megatron_loader"):
        got = _merged([{"view": r["views"][how]} for r in results], "view")
        for part in ("weights", *STATES):
            assert set(got[part]) == set(want[part]), (how, part)
            unequal = [n for n in want[part] if not torch.equal(got[part][n], want[part][n])]
            assert not unequal, f"{how} {part}: {unequal[:5]}"
