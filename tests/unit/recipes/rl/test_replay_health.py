"""Routing replay's health in the step (moe_rl/recipes/rl/replay_health.py): R3 coverage counted from
what is replayed and refused below algo.replay_min_coverage naming samples and layers; the trainer's
own routes replayed where the engine has none; a server whose layers are shifted refused naming the
offset; the route mask in the objective and its metrics, against plain loops."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.samples import Samples, response_mask
from moe_rl.recipes.rl.batch import replay_coverage
from moe_rl.recipes.rl.replay_health import LayerOffsetError, ReplayCoverageError, coverage
from moe_rl.recipes.rl.run import Run
from moe_rl.recipes.rl.step import _loss_fn, loss_extras
from moe_rl.recipes.rl.old_pass import old_logprobs

PROMPT, COMPLETIONS = 3, [8, 6, 9, 7]
LAYERS, K, E = [1, 2, 3, 4], 2, 4  # HF layer ids of the MoE layers (layer 0 dense), top-2 of 4 experts


def _table(seed: int, width: int) -> torch.Tensor:
    """`[B, width, L, K]` routes, each a random distinct top-k (chance overlap k/E = 0.5, the tiny models')."""
    g = torch.Generator().manual_seed(seed)
    n = len(COMPLETIONS) * width * len(LAYERS)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).view(len(COMPLETIONS), width,
                                                                                     len(LAYERS), K)


WIDTH = PROMPT + max(COMPLETIONS) - 1
FREE = _table(0, WIDTH)  # the trainer's own routes of the old pass


class _Policy:
    """The old pass as fixed tables: log-probs and free routes; records what it was asked to replay."""

    dp_size, dp_group = 1, None
    arch = SimpleNamespace(moe_layers=LAYERS, num_moe_experts=E)

    def __init__(self, logp: torch.Tensor | None = None) -> None:
        self.logp = torch.zeros(len(COMPLETIONS), WIDTH) if logp is None else logp
        self.calls, self.replayed = [], None

    def logprobs(self, sequences, *, record_routes=False, replay_routes=None, **_):
        width = max(s.shape[0] for s in sequences) - 1
        self.calls.append("free" if record_routes else "replay" if replay_routes is not None else "plain")
        if replay_routes is not None:
            self.replayed = replay_routes.clone()
        return SimpleNamespace(logp=self.logp[:, :width], routes=FREE[:, :width].clone() if record_routes else None)


def _samples(engine: torch.Tensor, rows: list[int | None] | None = None) -> Samples:
    """Samples whose engine routes are `engine`'s first rows (`rows[i]`; None: the sample has none)."""
    rows = rows or [PROMPT + n - 1 for n in COMPLETIONS]
    seqs = [torch.arange(PROMPT + n) % 7 for n in COMPLETIONS]
    return Samples(prompts=list(range(len(COMPLETIONS))), sequences=seqs,
                   prompt_lens=torch.full((len(COMPLETIONS),), PROMPT),
                   engine_logp=[torch.zeros(n) for n in COMPLETIONS],
                   routes=[None if r is None else engine[i, :r].to(torch.uint8) for i, r in enumerate(rows)],
                   completions=[""] * len(COMPLETIONS), rewards=torch.tensor([1.0, 0.0, 0.5, 0.0]),
                   advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))


def _run(policy: _Policy, *overrides: str) -> Run:
    cfg = load_config(None, ["drift.enabled=false", "rollout.return_routed_experts=true", *overrides])
    return Run(cfg=cfg, policy=policy, dataset=None, sampler=None, rewards=None, engine=None, weight_sync=None,
               eos_id=2)


def _near(routes: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    """`routes` with about `share` of the (token, layer) top-k sets redrawn: an engine that mostly agrees."""
    out, other = routes.clone(), _table(seed, routes.shape[1])
    redraw = torch.rand(routes.shape[:3], generator=torch.Generator().manual_seed(seed)) < share
    out[redraw] = other[redraw]
    return out


def test_coverage_counts_the_engine_routes_per_layer_and_names_the_samples_without():
    engine = _near(FREE, 0.05, 1)
    full = [PROMPT + n - 1 for n in COMPLETIONS]
    rows = [full[0], None, full[2] - 3, full[3]]  # sample 1 aborted (no routes); sample 2 three rows short
    mine = _samples(engine, rows)
    response = response_mask(mine, WIDTH).bool()
    got = coverage(mine, response, LAYERS, min_coverage=0.0)
    # the loop: a (token, layer) is covered when the sample has that row (every row there passed
    # moe_rl.routes.check where it arrived: test_routes.py)
    for name, where in (("replay/coverage", lambda i, t: bool(response[i, t])),
                        ("replay/coverage_prompt", lambda i, t: t < PROMPT - 1)):
        per_layer = []
        for j in range(len(LAYERS)):
            hit = total = 0
            for i, n in enumerate(COMPLETIONS):
                for t in range(PROMPT + n - 1):
                    if where(i, t):
                        total += 1
                        hit += rows[i] is not None and t < rows[i]
            per_layer.append(hit / total)
        assert got[name] == pytest.approx(min(per_layer)), name
        if name == "replay/coverage":
            for lid, v in zip(LAYERS, per_layer):
                assert got[f"replay/coverage/layer_{lid:02d}"] == pytest.approx(v)
    with pytest.raises(ReplayCoverageError, match=r"2 of 4 samples .*sample 1: 6 of 6 response and 2 of 2 prompt "
                                                  r"tokens, layers \[1, 2, 3, 4\]; sample 2: 3 of 9 response"):
        coverage(mine, response, LAYERS, min_coverage=1.0)
    # rank 0 of the step: under R3 only, from the run's config
    assert replay_coverage(_run(_Policy(), "algo.replay=r2"), mine) == {}
    with pytest.raises(ReplayCoverageError, match="algo.replay_min_coverage=1.0"):
        replay_coverage(_run(_Policy(), "algo.replay=r3"), mine)
    assert replay_coverage(_run(_Policy(), "algo.replay=r3", "algo.replay_min_coverage=0.3"), mine)[
        "replay/coverage"] == got["replay/coverage"]


def test_r3_replays_the_trainer_routes_where_the_engine_has_none():
    engine = _near(FREE, 0.05, 2)
    full = [PROMPT + n - 1 for n in COMPLETIONS]
    mine = _samples(engine, [full[0], None, full[2] - 3, full[3]])
    policy = _Policy()
    run = _run(policy, "algo.replay=r3", "algo.replay_min_coverage=0.3")
    old = old_logprobs(run, mine, step=1)
    assert policy.calls == ["free", "replay"]
    for i, n in enumerate(COMPLETIONS):
        have = {0: full[0], 1: 0, 2: full[2] - 3, 3: full[3]}[i]
        assert torch.equal(policy.replayed[i, :have].long(), engine[i, :have]), i
        assert torch.equal(policy.replayed[i, have:PROMPT + n - 1].long(), FREE[i, have:PROMPT + n - 1]), i
    assert torch.equal(old.replay, policy.replayed)
    policy.calls = []
    old_logprobs(run, mine, step=2)  # below 1.0 every step needs the trainer's own routes
    assert policy.calls == ["free", "replay"]


@pytest.mark.parametrize("shift", [1, -1])
def test_a_server_with_shifted_layers_fails_naming_the_offset(shift):
    engine = _near(FREE, 0.03, 3)
    moved = _table(4, WIDTH)  # what the server puts where no trainer layer maps (random ids)
    if shift == 1:   # the engine's layer j holds the trainer's layer j - 1
        moved[:, :, 1:] = engine[:, :, :-1]
    else:            # the engine's layer j holds the trainer's layer j + 1
        moved[:, :, :-1] = engine[:, :, 1:]
    policy = _Policy()
    run = _run(policy, "algo.replay=r3")
    first = 2 if shift == 1 else 1
    message = (f"the engine's routes of MoE layer {first} equal the trainer's layer {first - shift} .* "
               + re.escape(f"{-shift:+d} layer off"))
    with pytest.raises(LayerOffsetError, match=message):
        old_logprobs(run, _samples(moved), step=1)
    # the same engine with its layers in place passes, and later steps run no free pass for it
    policy = _Policy()
    run = _run(policy, "algo.replay=r3")
    old_logprobs(run, _samples(engine), step=1)
    policy.calls = []
    old_logprobs(run, _samples(engine), step=2)
    assert policy.calls == ["replay"]


@pytest.mark.parametrize("replay,max_flips", [("r2", 0), ("off", 1), ("r3", 1)])
def test_route_mask_in_the_step_against_the_loop(replay, max_flips):
    engine = _near(FREE, 0.25, 5)
    mine = _samples(engine)
    g = torch.Generator().manual_seed(6)
    prox = -torch.rand(len(COMPLETIONS), WIDTH, generator=g) - 0.2
    theta = prox + 0.3 * (torch.rand(prox.shape, generator=g) - 0.5)
    native = ["algo.rollout_correction.route_mask.native=true"] if replay == "r3" else []
    run = _run(_Policy(prox), f"algo.replay={replay}", "algo.loss=grpo", "algo.rollout_correction.mode=route_mask",
               f"algo.rollout_correction.route_mask.max_flips={max_flips}", *native)
    old = old_logprobs(run, mine, step=1)
    # the loop: response tokens whose top-k sets differ in more than max_flips layers
    total, masked, flips = 0, 0, [0] * len(LAYERS)
    keep = torch.ones(len(COMPLETIONS), WIDTH)
    for i, n in enumerate(COMPLETIONS):
        for t in range(PROMPT - 1, PROMPT + n - 1):
            differ = [set(engine[i, t, j].tolist()) != set(FREE[i, t, j].tolist()) for j in range(len(LAYERS))]
            total += 1
            flips = [f + d for f, d in zip(flips, differ)]
            if sum(differ) > max_flips:
                masked += 1
                keep[i, t] = 0
    assert 0 < masked < total
    assert old.metrics["correction/route_masked_frac"] == pytest.approx(masked / total)
    for lid, f in zip(LAYERS, flips):
        assert old.metrics[f"correction/route_flip_frac/layer_{lid:02d}"] == pytest.approx(f / total)
    extras = loss_extras(mine, old)
    num_tokens = float(extras["mask"].sum())  # the normalisers stay the unmasked batch's
    leaf = theta.clone().requires_grad_(True)
    value, _ = _loss_fn(run, num_tokens, 4.0)(leaf, SimpleNamespace(index=torch.arange(4), extras=extras))
    # GRPO: each sequence's mean over its kept tokens (a fully masked one adds 0), over all 4 sequences
    ref = 0.0
    for i, n in enumerate(COMPLETIONS):
        per_seq, kept = 0.0, 0
        for t in range(PROMPT - 1, PROMPT + n - 1):
            if keep[i, t]:
                r = torch.exp(theta[i, t] - prox[i, t])
                per_seq = per_seq - torch.minimum(r * mine.advantages[i], r.clamp(0.8, 1.2) * mine.advantages[i])
                kept += 1
        ref = ref + (per_seq / kept if kept else 0.0)
    assert float(value.detach()) == pytest.approx(float(ref / len(COMPLETIONS)), rel=1e-5)


def test_without_the_route_mask_nothing_is_masked_and_no_metric_is_logged():
    mine = _samples(_near(FREE, 0.25, 5))
    old = old_logprobs(_run(_Policy(), "algo.replay=r2", "algo.rollout_correction.mode=icepop"), mine, step=1)
    assert old.route_keep is None and old.metrics == {}
    assert bool(loss_extras(mine, old)["route_keep"].all())


@pytest.mark.parametrize("family", ["glm4_moe"])
def test_the_offset_check_on_a_tiny_model_with_a_dense_first_layer(family):
    """Real routers (a dense first layer, 4 experts, top-2: chance overlap 0.5, the hardest case): an
    engine one version away passes; one that reads its MoE layers one layer off is refused."""
    from transformers import AutoModelForCausalLM

    from moe_rl.drift.routes import hf_routes
    from moe_rl.policy.families.registry import tiny_hf_config
    from moe_rl.policy.tiny import TinyMoEConfig
    from moe_rl.recipes.rl.replay_health import check_layer_offset

    torch.manual_seed(0)
    config = tiny_hf_config(family, TinyMoEConfig(num_hidden_layers=5))
    config.initializer_range = 0.2  # the tiny checkpoints' init: routers far from uniform
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trainer = hf_routes(model, ids).flatten(0, 1)  # [N, L, K]
        for name, p in model.named_parameters():  # the engine: routers one small update away
            if "gate" in name:
                p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        engine = hf_routes(model, ids).flatten(0, 1)
    layers = [1, 2, 3, 4]
    assert trainer.shape[1] == len(layers)
    check_layer_offset(engine, trainer, None, layers)
    shifted = engine.clone()
    shifted[:, 1:] = engine[:, :-1]  # the engine's layer j holds its layer j - 1; layer 1 keeps its own
    with pytest.raises(LayerOffsetError, match="MoE layer 2 equal the trainer's layer 1"):
        check_layer_offset(shifted, trainer, None, layers)
