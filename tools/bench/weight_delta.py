"""How much of the pushed weights changes per RL step: would delta weight pushes pay?

Runs the demo RL task (launch/configs/tiny_cpu.yaml: a fresh tiny Qwen3-MoE learning one-digit
addition with GSPO + R2 on 2 gloo ranks, EP2, `moe-rl serve` as rollout server) for `--steps`
RL steps at each learning rate, in-process as `moe-rl train` builds it (`common.trainer_run`,
`rl_step`); everything but `train.lr` (and quiet logging: no eval, saves or progress bar) is the
demo's. Before the first step and after each step's optimizer updates (the demo takes
`algo.num_minibatches=2` per step; a push follows the last) every rank takes the HF-named
tensors a weight push sends (`Policy.hf_tensors()`), casts them to bfloat16, the dtype SGLang
servers hold, and compares them bit for bit with the previous step's. Reported per learning rate
(medians over the steps):

- changed: the fraction of bf16 elements whose bits changed since the last push;
- unchanged tensors: the fraction of whole tensors with no element changed;
- bytes of a delta push against a full bf16 push (2 bytes per element), in two encodings:
  whole tensors (every tensor with a change, whole), and elements (int32 index + bf16 value,
  6 bytes per changed element) taking per tensor whichever of the two is smaller; the pure
  element encoding (6 bytes per changed element everywhere) is in the JSON rows.

The same per tensor kind (`tensor_kind`: attention, router, shared expert, routed experts,
embeddings and lm_head, layer norms). Per routed expert and step: its changed fraction (over its
gate/up/down projections) against the tokens routed to it in that step's updates (the routes the
updates replay, R2, summed over the updates and the DP ranks' shares; real tokens only), and
against its gradient tokens: those whose expert output reaches a loss term of a sample with a
nonzero advantage (positions up to the sample's last loss row; in the last decoder layer only the
loss rows themselves, as no attention follows it). Spearman's rank correlation over all (layer,
expert, step) points, and the mean changed fraction of the points with no tokens routed, with
gradient tokens, with none in the step but some in an earlier one (Adam's momentum keeps moving
it), and with none so far.

About 50 s on 2 cores for the default three learning rates of 6 steps.

    python tools/bench/weight_delta.py                          # lr 1e-6, 1e-5, 1e-3; 6 steps each
    python tools/bench/weight_delta.py --steps 10 --lrs 1e-5 --json delta.json
    python tools/bench/weight_delta.py --set model.tiny.num_experts=16   # overrides, as for moe-rl train
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "launch" / "configs" / "tiny_cpu.yaml"
LRS = (1e-6, 1e-5, 1e-3)
STEPS = 6
VALUE_BYTES, INDEX_BYTES = 2, 4  # bf16 value, int32 index
KINDS = ("attention", "router", "shared expert", "routed experts", "embeddings and lm_head", "layer norms",
         "dense mlp", "other")
QUIET = ["log.progress=false", "log.tensorboard=false", "train.eval_every=0", "train.save_every=0"]

_EXPERT = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.(\d+)\.")


# ---------------------------------------------------------------- accounting (pure, unit-tested)

def tensor_kind(name: str) -> str:
    """The kind of a HF tensor name, one of `KINDS`."""
    if ".self_attn." in name or ".linear_attn." in name:
        return "attention"  # q/k/v/o projections and the q/k norms inside attention
    if ".mlp.shared_expert" in name:
        return "shared expert"  # shared_expert.{gate,up,down}_proj and shared_expert_gate
    if ".mlp.experts." in name:
        return "routed experts"
    if name.endswith(".mlp.gate.weight") or "e_score_correction_bias" in name:
        return "router"
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embeddings and lm_head"
    if "layernorm" in name or name in ("model.norm.weight", "norm.weight") or name.endswith(".norm.weight"):
        return "layer norms"
    if ".mlp." in name:
        return "dense mlp"  # the MLP of a dense layer (not MoE)
    return "other"


def expert_of(name: str) -> tuple[int, int] | None:
    """(layer, expert) of a routed expert's tensor, else None."""
    m = _EXPERT.search(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def changed_elements(prev: torch.Tensor, cur: torch.Tensor) -> int:
    """How many elements differ bit for bit (what a delta push would have to send)."""
    if prev.shape != cur.shape or prev.dtype != cur.dtype:
        raise ValueError(f"cannot compare {tuple(prev.shape)} {prev.dtype} with {tuple(cur.shape)} {cur.dtype}")
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[cur.element_size()]
    return int(prev.contiguous().view(bits).ne(cur.contiguous().view(bits)).sum())


def push_bytes(numel: int, changed: int) -> dict[str, int]:
    """Bytes of one tensor's push: `full` bf16, the delta as the whole tensor when any element
    changed (`tensor`), as index + value per changed element (`element`), and the smaller (`best`)."""
    full = numel * VALUE_BYTES
    tensor = full if changed else 0
    element = changed * (INDEX_BYTES + VALUE_BYTES)
    return {"full": full, "tensor": tensor, "element": element, "best": min(tensor, element)}


def step_summary(numel: dict[str, int], changed: dict[str, int], names: Iterable[str]) -> dict[str, float]:
    """One step over the tensors `names`: changed element fraction, fraction of tensors left whole,
    and each encoding's bytes over the full bf16 push of those tensors."""
    names = list(names)
    tot = {"full": 0, "tensor": 0, "element": 0, "best": 0}
    for n in names:
        for k, v in push_bytes(numel[n], changed[n]).items():
            tot[k] += v
    elements = sum(numel[n] for n in names)
    return {"changed": sum(changed[n] for n in names) / elements,
            "unchanged_tensors": sum(changed[n] == 0 for n in names) / len(names),
            "tensor_bytes": tot["tensor"] / tot["full"], "element_bytes": tot["element"] / tot["full"],
            "best_bytes": tot["best"] / tot["full"]}


def _ranks(xs: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's of the tie-averaged ranks); nan when either side is constant."""
    if len(xs) != len(ys):
        raise ValueError("spearman: sequences of different lengths")
    rx, ry = _ranks(xs), _ranks(ys)
    n = len(rx)
    if n < 2:
        return float("nan")
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else float("nan")


# ---------------------------------------------------------------- one run (every rank)

def _bf16_snapshot(policy: Any) -> dict[str, torch.Tensor]:
    """This rank's share of the pushed tensors, as the servers would hold them (collective)."""
    return {name: t.detach().to("cpu", torch.bfloat16, copy=True) for name, t in policy.hf_tensors()}


class RouteCounter:
    """Tokens per (MoE layer, expert) in the policy's updates since `reset`, on this rank's share.

    `routed`: every real token of the updated sequences (padding and each sequence's unrouted last
    token aside). `gradient`: the tokens whose expert output reaches a loss term of a sample with a
    nonzero advantage, the only ones that send the expert a gradient: in a layer that attention
    layers follow, the sample's positions up to its last loss position (causal attention carries
    them forward); in the last decoder layer only the loss positions themselves (nothing mixes
    positions after it).
    """

    def __init__(self, policy: Any) -> None:
        from moe_rl.drift.metrics import expert_load

        self.policy, self._load = policy, expert_load
        arch = policy.arch
        self.last = [layer == arch.num_layers - 1 for layer in arch.moe_layers]
        self.experts = int(arch.num_moe_experts)
        self._update = policy.update
        policy.update = self._counted_update  # the instance attribute shadows the method
        self.reset()

    def reset(self) -> None:
        self.routed = torch.zeros(len(self.last), self.experts, dtype=torch.long)
        self.gradient = torch.zeros_like(self.routed)

    def count(self, routes: torch.Tensor, lengths: torch.Tensor, loss_mask: torch.Tensor, adv: torch.Tensor) -> None:
        """Add one update's tokens: `routes` [B, >= T - 1, L, K], `loss_mask` [B, >= T - 1] (row t: the
        log-prob of token t + 1, computed at token t), `adv` [B] or [B, T - 1]."""
        width = int(lengths.max()) - 1
        pos = torch.arange(width).view(1, -1)
        real = pos < (lengths - 1).view(-1, 1)  # [B, width]
        moving = adv.ne(0) if adv.dim() == 1 else adv.ne(0).any(dim=1)  # [B]
        loss = loss_mask[:, :width].ne(0) & moving.view(-1, 1) & real
        last_loss = torch.where(loss, pos, -1).max(dim=1).values  # [B]; -1: no loss term
        upstream = (pos <= last_loss.view(-1, 1)) & real
        flat = routes[:, :width][real]  # [N, L, K]
        self.routed += self._load(flat, self.experts)
        for j, last in enumerate(self.last):
            self.gradient[j] += self._load(flat[:, j:j + 1], self.experts, mask=(loss if last else upstream)[real])[0]

    def _counted_update(self, sequences: list[torch.Tensor], extras: dict[str, torch.Tensor], loss: Any,
                        replay_routes: torch.Tensor | None = None, **kw: Any) -> Any:
        routes = replay_routes
        if routes is None:  # replay off: the routers route freely, from the same weights as this pass
            routes = self.policy.logprobs(sequences, record_routes=True).routes
        mask = extras["mask"] * extras["route_keep"] if "route_keep" in extras else extras["mask"]
        self.count(routes, torch.tensor([len(s) for s in sequences]), mask, extras["adv"])
        return self._update(sequences, extras, loss, replay_routes=replay_routes, **kw)


def delta_rank(cfg_dict: dict[str, Any], out: str, steps: int) -> dict[str, Any]:
    """One rank of one run: per step, the changed bf16 elements of each tensor this rank pushes and
    the tokens per expert of its share; step 0 is the initial model."""
    import torch.distributed as dist

    from common import trainer_run
    from moe_rl.recipes.rl.step import rl_step

    with trainer_run(cfg_dict, out) as run:
        counter = RouteCounter(run.policy) if run.policy.arch.num_moe_experts else None
        prev = _bf16_snapshot(run.policy)
        numel = {n: t.numel() for n, t in prev.items()}
        per_step = []
        for step in range(1, steps + 1):
            if counter:
                counter.reset()
            t0 = time.perf_counter()
            metrics = rl_step(run, step)
            step_s = time.perf_counter() - t0
            cur = _bf16_snapshot(run.policy)
            per_step.append({"changed": {n: changed_elements(prev[n], cur[n]) for n in cur},
                             "routed": counter.routed.tolist() if counter else None,
                             "gradient": counter.gradient.tolist() if counter else None,
                             "success": float(metrics.get("reward/success_rate", float("nan"))),
                             "step_s": step_s})
            prev = cur
        layers = list(run.policy.arch.moe_layers)
    return {"rank": dist.get_rank(), "numel": numel, "steps": per_step, "moe_layers": layers}


def _merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' shares as one push: each HF tensor comes from exactly one rank; tokens add up."""
    numel: dict[str, int] = {}
    for r in results:
        numel |= r["numel"]
    steps = []
    for s in range(len(results[0]["steps"])):
        parts = [r["steps"][s] for r in results]
        changed: dict[str, int] = {}
        for p in parts:
            changed |= p["changed"]
        merged = {"changed": changed, "success": parts[0]["success"], "step_s": max(p["step_s"] for p in parts)}
        for key in ("routed", "gradient"):
            merged[key] = None if parts[0][key] is None else \
                sum(torch.tensor(p[key], dtype=torch.long) for p in parts).tolist()
        steps.append(merged)
    return {"numel": numel, "steps": steps, "moe_layers": results[0]["moe_layers"]}


# ---------------------------------------------------------------- rows

def _expert_points(run: dict[str, Any]) -> list[dict[str, float]]:
    """One point per (MoE layer, expert, step): changed fraction, tokens routed, gradient tokens, and
    the gradient tokens of the earlier steps (Adam's momentum keeps moving an expert they reached)."""
    groups: dict[tuple[int, int], list[str]] = {}
    for n in run["numel"]:
        key = expert_of(n)
        if key is not None:
            groups.setdefault(key, []).append(n)
    column = {layer: i for i, layer in enumerate(run["moe_layers"])}
    points, before = [], dict.fromkeys(groups, 0)
    for s, step in enumerate(run["steps"], start=1):
        if step["routed"] is None:
            break
        for (layer, e), names in sorted(groups.items()):
            frac = sum(step["changed"][n] for n in names) / sum(run["numel"][n] for n in names)
            grad = step["gradient"][column[layer]][e]
            points.append({"step": s, "layer": layer, "expert": e, "changed": frac,
                           "routed": step["routed"][column[layer]][e], "gradient": grad,
                           "gradient_before": before[(layer, e)]})
            before[(layer, e)] += grad
    return points


def _mean_or_nan(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _expert_stats(points: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {"expert_points": len(points)}
    for key in ("routed", "gradient"):
        out[f"spearman_{key}"] = spearman([p[key] for p in points], [p["changed"] for p in points])
        zero = [p["changed"] for p in points if p[key] == 0]
        out[f"zero_{key}_points"], out[f"zero_{key}_changed"] = len(zero), _mean_or_nan(zero)
    # points without gradient tokens this step: never reached so far, or reached in an earlier step
    for name, earlier in (("never", False), ("momentum", True)):
        got = [p["changed"] for p in points if p["gradient"] == 0 and (p["gradient_before"] > 0) == earlier]
        out[f"{name}_points"], out[f"{name}_changed"] = len(got), _mean_or_nan(got)
    with_grad = [p["changed"] for p in points if p["gradient"] > 0]
    out["gradient_points"], out["gradient_changed"] = len(with_grad), _mean_or_nan(with_grad)
    busy = sorted(p["routed"] for p in points)
    out["routed_min"], out["routed_max"] = (busy[0], busy[-1]) if busy else (0, 0)
    return out


def summarize(lr: float, run: dict[str, Any], wall_s: float) -> list[dict[str, Any]]:
    """Rows of one learning rate: `kind="all"` (with the per-expert statistics), then one per kind present."""
    numel = run["numel"]
    by_kind: dict[str, list[str]] = {}
    for n in numel:
        by_kind.setdefault(tensor_kind(n), []).append(n)
    total_bytes = sum(numel.values()) * VALUE_BYTES
    rows = []
    for kind in ("all", *[k for k in KINDS if k in by_kind]):
        names = list(numel) if kind == "all" else by_kind[kind]
        per_step = [step_summary(numel, s["changed"], names) for s in run["steps"]]
        row: dict[str, Any] = {"lr": lr, "kind": kind, "tensors": len(names),
                               "elements": sum(numel[n] for n in names),
                               "push_share": sum(numel[n] for n in names) * VALUE_BYTES / total_bytes,
                               "steps": len(per_step)}
        for key in per_step[0]:
            row[key] = common.median([p[key] for p in per_step])
        row["changed_per_step"] = [p["changed"] for p in per_step]
        if kind == "all":
            points = _expert_points(run)
            row |= _expert_stats(points) | {"experts": points}
            row["success_per_step"] = [s["success"] for s in run["steps"]]
            row["step_s"] = common.median([s["step_s"] for s in run["steps"]])
            row["wall_s"] = wall_s
            row["updates_per_step"], row["overrides"] = run["updates_per_step"], run["overrides"]
        rows.append(row)
    return rows


def run_lr(lr: float, steps: int, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """One demo run at `lr` for `steps` steps: its merged per-step record."""
    from moe_rl.config import load_config
    from moe_rl.dist.spawn import run_ranks

    with tempfile.TemporaryDirectory(prefix="weight_delta_") as out:
        cfg = load_config(str(DEMO), QUIET + [f"train.lr={lr}", f"train.steps={max(steps, 1)}",
                                             f"log.run_dir={out}", *overrides])
        results = run_ranks(delta_rank, cfg.train.world_size, cfg.to_dict(), out, steps, timeout=1800)
    return _merge(sorted(results, key=lambda r: r["rank"])) | {"updates_per_step": cfg.algo.num_minibatches,
                                                               "overrides": list(overrides)}


def bench_rows(steps: int = STEPS, lrs: Sequence[float] = LRS, overrides: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Per learning rate: a `kind="all"` row, then one row per tensor kind (see `summarize`)."""
    rows = []
    for lr in lrs:
        t0 = time.perf_counter()
        run = run_lr(lr, steps, overrides)
        rows += summarize(lr, run, time.perf_counter() - t0)
    return rows


# ---------------------------------------------------------------- tables

def _pct(x: float) -> str:
    if x != x:
        return "—"
    if x == 0:
        return "0"
    return f"{x:.2%}" if x >= 1e-3 else f"{x:.1e}"


def _corr(x: float) -> str:
    return "—" if x != x else f"{x:+.2f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    alls = [r for r in rows if r["kind"] == "all"]
    first = alls[0]
    changes = f" with {' '.join(first['overrides'])}" if first["overrides"] else ""
    head = (f"Demo task (launch/configs/tiny_cpu.yaml{changes}: {first['elements'] / 1e3:.0f}k parameters, "
            f"{first['tensors']} HF tensors), {first['steps']} RL steps per learning rate, "
            f"{first['updates_per_step']} optimizer updates per step; pushed tensors cast to bf16, each push "
            "compared bit for bit with the one before (step 1: with the initial model). Medians over the steps; "
            "bytes are a delta push's over a full bf16 push; element encoding: int32 index + bf16 value per "
            "changed element, or the whole tensor where that is smaller.")
    overall = common.md_table(
        ["lr", "changed elements (min–max over steps)", "unchanged tensors", "delta bytes: whole tensors",
         "delta bytes: elements", "success per step", "s / step"],
        [[f"{r['lr']:g}", f"{_pct(r['changed'])} ({_pct(min(r['changed_per_step']))}–"
          f"{_pct(max(r['changed_per_step']))})", _pct(r["unchanged_tensors"]), _pct(r["tensor_bytes"]),
          _pct(r["best_bytes"]), " ".join(f"{s:.2f}" for s in r["success_per_step"]), f"{r['step_s']:.1f}"]
         for r in alls])
    kinds = common.md_table(
        ["lr", "kind", "share of push", "tensors", "changed elements", "unchanged tensors",
         "delta bytes: whole tensors", "delta bytes: elements"],
        [[f"{r['lr']:g}", r["kind"], _pct(r["push_share"]), r["tensors"], _pct(r["changed"]),
          _pct(r["unchanged_tensors"]), _pct(r["tensor_bytes"]), _pct(r["best_bytes"])]
         for r in rows if r["kind"] != "all"], align="llrrrrrr")
    experts = common.md_table(
        ["lr", "points", "tokens routed (min–max)", "Spearman: changed vs tokens routed", "vs gradient tokens",
         "changed: 0 tokens routed", "changed: gradient tokens", "changed: none now, some before",
         "changed: none yet"],
        [[f"{r['lr']:g}", r["expert_points"], f"{r['routed_min']}–{r['routed_max']}", _corr(r["spearman_routed"]),
          _corr(r["spearman_gradient"]), f"{_pct(r['zero_routed_changed'])} (n={r['zero_routed_points']})",
          f"{_pct(r['gradient_changed'])} (n={r['gradient_points']})",
          f"{_pct(r['momentum_changed'])} (n={r['momentum_points']})",
          f"{_pct(r['never_changed'])} (n={r['never_points']})"]
         for r in alls if r.get("expert_points")])
    expert_note = ("Per routed expert and step (points: MoE layer × expert × step; tokens summed over the step's "
                   "updates and ranks; gradient tokens: those whose expert output reaches a loss term with a "
                   "nonzero advantage: in the last layer only the loss positions). changed: mean changed "
                   "fraction of the points with gradient tokens in the step, with none in the step but some in "
                   "an earlier one (Adam's momentum), and with none so far:")
    return "\n\n".join([head, overall, "Per tensor kind:", kinds,
                        expert_note, experts])


def _finite(x: Any) -> Any:
    """`x` with NaN as None (valid JSON)."""
    if isinstance(x, float):
        return None if x != x else x
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=STEPS, help="RL steps per learning rate")
    p.add_argument("--lrs", type=float, nargs="+", default=list(LRS), help="train.lr of each run")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="dotlist overrides of the demo config, as for `moe-rl train`")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = bench_rows(a.steps, a.lrs, a.set)
    print(format_table(rows))
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(_finite(rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
