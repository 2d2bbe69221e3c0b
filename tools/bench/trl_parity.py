"""Generations, samples and time to a success rate, moe_rl against TRL's GRPOTrainer, same task and CPU.

Both train the same freshly initialised tiny Qwen3-MoE (4 layers, hidden 64, 8 experts
top-2; one checkpoint per seed written by `moe_rl.testing.make_tiny_qwen3_moe`) from scratch,
with GSPO at the paper's clip range (3e-4, 4e-4), no KL, group-normalised advantages
(std + 1e-4, TRL's), Adam at a constant learning rate, gradient clipping at 1.0, sampling at
temperature 1, and moe_rl's toy exact-match reward. Two presets (`--preset`):

- `demo` (default): the demo's run (launch/configs/tiny_cpu.yaml): `toy:add-easy` (9 prompts)
  x 16 samples of 1 new token, 2 optimizer steps per generation, lr 1e-3.
- `extended`: a more common RL setting: `toy:last-parity` (1,000 distinct prompts, answer
  `c mod 2` of `abc=`), 32 prompts x 8 samples of 2 new tokens (the digit, then `<eos>`:
  chance 1/256), 4 optimizer steps per generation, at lr 1e-3 and at lr 3e-3.

`--task --lr --samples --new-tokens --updates --max-generations` change every setting of the
preset (`--lr` takes several values: one setting each).

- TRL: `GRPOTrainer` with `importance_sampling_level="sequence"`, `loss_type="grpo"`
  (per-sequence mean, as moe_rl's GSPO), generation by transformers in the same process.
- moe_rl: `rl_step` as `moe-rl train` runs it, in the variants of `VARIANTS`.

Each side runs in its own process, one after the other, once per seed (`--seeds`: each seed
a fresh model, prompt and minibatch order and sampling noise, for both sides). Reported per
side and setting: the first generation whose batch success rate (share of samples with
reward 1) reaches the target, the samples generated up to it, the training seconds up to it
(TRL: from the start of training to the log of that generation's rewards; moe_rl: the summed
`perf/step_s` of the steps up to it; model building and imports excluded on both sides), and
the seconds per generation after the first (the steady rate, whether or not the target is
reached); medians over the seeds, a seed that missed counting as the largest. TRL is an
optional dependency (`pip install -e ".[bench]"`); without it the section says so and
reports moe_rl alone.

Ablations: `--set key=value ...` adds moe_rl config overrides to every moe_rl variant,
`--trl-set key=value ...` GRPOConfig fields to the TRL side, and `--train-pad-row` trains
HF's padding embedding row as megatron's embedding alone would (the behaviour before
`moe_rl.policy.train_step.frozen_rows`). `--json FILE` writes every run's numbers and
success curve.

    python tools/bench/trl_parity.py
    python tools/bench/trl_parity.py --preset extended
    python tools/bench/trl_parity.py --preset extended --lr 3e-3 --variants demo --set algo.replay=off
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import md_table

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "launch" / "configs" / "tiny_cpu.yaml"
TRL = "TRL GRPOTrainer"  # the TRL side's row
SEEDS = [1234, 1235, 1236]  # each seed: a fresh model, prompt order and sampling noise for both sides
EPS_LOW, EPS_HIGH = 3e-4, 4e-4  # the GSPO paper's clip range (moe_rl's GSPO default)
ADV_EPS = 1e-4  # TRL's: advantages (R - mean) / (std + 1e-4); moe_rl's default is 1e-6
MAX_PROMPTS = 32  # prompts per generation, or all of a smaller task's


@dataclass(frozen=True)
class Setting:
    """One run both sides make: task, learning rate, batch shape, budget."""

    task: str = "add-easy"
    lr: float = 1e-3
    samples: int = 16         # per prompt
    new_tokens: int = 1       # max new tokens per sample
    updates: int = 2          # optimizer steps per generation
    max_generations: int = 150

    @property
    def prompts(self) -> int:
        from moe_rl.data.toy import make_toy_examples

        return min(MAX_PROMPTS, len(make_toy_examples(self.task)))

    @property
    def per_generation(self) -> int:
        return self.prompts * self.samples

    def describe(self) -> str:
        return (f"toy:{self.task}, {self.prompts} prompts x {self.samples} samples, {self.new_tokens} new "
                f"token{'s' * (self.new_tokens > 1)}, {self.updates} updates per generation, GSPO eps "
                f"({EPS_LOW}, {EPS_HIGH}), lr {self.lr:g}")


PRESETS: dict[str, tuple[Setting, ...]] = {
    "demo": (Setting(),),
    "extended": tuple(Setting("last-parity", lr, samples=8, new_tokens=2, updates=4, max_generations=200)
                      for lr in (1e-3, 3e-3)),
}


def common(s: Setting, seed: int) -> list[str]:
    """The run both sides share, as moe_rl config overrides on the demo config."""
    return [f"data.train=toy:{s.task}", "data.eval=null", f"data.prompts_per_step={s.prompts}",
            f"data.shuffle_seed={seed}", f"rollout.n_samples={s.samples}", f"rollout.max_new_tokens={s.new_tokens}",
            "rollout.temperature=1.0", "algo.loss=gspo", "algo.advantage=grpo", f"algo.adv_eps={ADV_EPS}",
            f"algo.num_minibatches={s.updates}", f"algo.eps_low={EPS_LOW}", f"algo.eps_high={EPS_HIGH}",
            f"train.lr={s.lr}", "train.lr_schedule=constant", "train.grad_clip=1.0", "train.eval_every=0",
            "train.save_every=0", "model.tiny.num_experts=8", "model.tiny.num_experts_per_tok=2",
            f"model.seed={seed}", "log.progress=false", "log.tensorboard=false"]


# moe_rl's variants: how it runs, each a list of overrides on top of `common`.
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "fast": ("1 process, engine in-process, tensor weight sync, no drift, no replay, one padded micro-batch per update",
             ["train.world_size=1", "parallel.ep=1", "rollout.engine=inprocess", "rollout.weight_sync=tensor",
              "rollout.return_routed_experts=false", "drift.enabled=false", "algo.replay=off",
              "parallel.max_tokens_per_microbatch=null", "parallel.micro_batch_size=256"]),
    "demo": ("the demo's layout: 2 ranks EP2, `moe-rl serve` over HTTP, disk weight sync, R2, drift every 5th step",
             []),
    "async": ("the demo's layout, asynchronous: `algo.max_staleness=2` (the next two batches generate while a step "
              "trains; pushes retract the requests they find), `algo.tis_cap=2`",
              ["algo.max_staleness=2", "algo.tis_cap=2.0"]),
    "async-1rank": ("`fast`'s trainer (1 rank, no drift, no replay, one padded micro-batch per update) with one "
                    "`moe-rl serve` generating the next two batches while it trains (`algo.max_staleness=2`, "
                    "`algo.tis_cap=2`), weights pushed over an update group",
                    ["train.world_size=1", "parallel.ep=1", "rollout.weight_sync=nccl",
                     "rollout.return_routed_experts=false", "drift.enabled=false", "algo.replay=off",
                     "parallel.max_tokens_per_microbatch=null", "parallel.micro_batch_size=256",
                     "algo.max_staleness=2", "algo.tis_cap=2.0"]),
}


# ---------------------------------------------------------------- the shared model

def write_initial_model(out: Path, seed: int, setting: Setting = Setting()) -> Path:
    """The fresh tiny Qwen3-MoE both sides start from (the checkpoint `moe-rl train` would write)."""
    from moe_rl.config import load_config
    from moe_rl.data.dataset import load_dataset
    from moe_rl.recipes.build import initial_model

    cfg = load_config(str(DEMO), common(setting, seed))
    return initial_model(cfg, out, 0, load_dataset(cfg.data.train, None))


# ---------------------------------------------------------------- moe_rl

def moe_rl_rank(cfg_dict: dict[str, Any], out: str, target: float, max_steps: int,
                train_pad_row: bool = False) -> list[dict[str, float]]:
    """One rank: RL steps until the batch success rate reaches `target` (every rank sees the same
    metrics, so all stop together); per step: success rate and seconds."""
    from common import trainer_run
    from moe_rl.recipes.rl.step import rl_step

    if train_pad_row:  # ablation: megatron's embedding as it is, every row trained
        import moe_rl.policy.policy as policy_module

        policy_module.frozen_rows = lambda arch: ()
    rows = []
    with trainer_run(cfg_dict, out) as run:
        for step in range(1, max_steps + 1):
            m = rl_step(run, step)
            rows.append({"success": m["reward/success_rate"], "step_s": m["perf/step_s"]})
            if m["reward/success_rate"] >= target:
                break
    return rows


def run_moe_rl(variant: str, setting: Setting, model_dir: str, out: str, target: float, seed: int,
               overrides: list[str], train_pad_row: bool = False) -> dict[str, Any]:
    from moe_rl.config import load_config
    from moe_rl.dist.spawn import run_ranks

    cfg = load_config(str(DEMO), common(setting, seed) + VARIANTS[variant][1] + list(overrides)
                      + [f"model.hf_path={model_dir}", f"log.run_dir={out}"])
    rows = run_ranks(moe_rl_rank, cfg.train.world_size, cfg.to_dict(), out, target, setting.max_generations,
                     train_pad_row, timeout=3600)[0]
    return summarise([r["success"] for r in rows], [sum(r["step_s"] for r in rows[: i + 1]) for i in range(len(rows))],
                     target, setting.per_generation)


# ---------------------------------------------------------------- TRL

def toy_hf_tokenizer() -> Any:
    """The toy tokenizer (one id per symbol, `moe_rl.data.toy.TOY_TOKENS`) as a HF fast tokenizer."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from moe_rl.data.toy import TOY_TOKENS

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(TOY_TOKENS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<pad>|<bos>|<eos>|."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def toy_reward(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], answer: list[str],
               **_: Any) -> list[float]:
    """moe_rl's toy exact match on the generated ids (TRL's reward-function signature)."""
    from moe_rl.reward.toy import toy_exact_match

    return [toy_exact_match("", a, completion_ids=list(ids)) for ids, a in zip(completion_ids, answer)]


def trl_config(setting: Setting, out: str, seed: int, overrides: dict[str, Any] | None = None) -> Any:
    """TRL's GRPOConfig for `setting` (the same run as `common`), plus `overrides`."""
    from trl import GRPOConfig

    kw = dict(
        output_dir=out, per_device_train_batch_size=setting.per_generation // setting.updates,
        steps_per_generation=setting.updates, num_generations=setting.samples,
        max_completion_length=setting.new_tokens, temperature=1.0, top_p=1.0, importance_sampling_level="sequence",
        loss_type="grpo", epsilon=EPS_LOW, epsilon_high=EPS_HIGH, beta=0.0, scale_rewards="group",
        learning_rate=setting.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        max_steps=setting.updates * setting.max_generations, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, seed=seed, disable_tqdm=True, dataloader_num_workers=0)
    return GRPOConfig(**(kw | (overrides or {})))


def run_trl(setting: Setting, model_dir: str, out: str, target: float, seed: int,
            overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    from moe_rl.data.toy import make_toy_examples

    torch.manual_seed(seed)
    tokenizer = toy_hf_tokenizer()
    data = Dataset.from_list([{"prompt": "<bos>" + ex.prompt_text, "answer": ex.answer}
                              for ex in make_toy_examples(setting.task)])
    args = trl_config(setting, out, seed, overrides)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    successes: list[float] = []
    seconds: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *_a: Any, **_k: Any) -> None:
            self.start = time.perf_counter()

        def on_log(self, _args: Any, _state: Any, control: Any, logs: dict | None = None, **_k: Any) -> None:
            key = next((k for k in (logs or {}) if k.startswith("rewards/") and k.endswith("/mean")), None)
            if key is None:  # only the first optimizer step of a generation logs its rewards
                return
            successes.append(float(logs[key]))  # rewards are 0/1: the mean is the success rate
            seconds.append(time.perf_counter() - self.start)
            if successes[-1] >= target:
                control.should_training_stop = True

    trainer = GRPOTrainer(model=model, reward_funcs=toy_reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    import trl

    return summarise(successes, seconds, target, setting.per_generation) | {"version": trl.__version__}


# ---------------------------------------------------------------- the comparison

def summarise(successes: list[float], seconds: list[float], target: float, per_generation: int) -> dict[str, Any]:
    """Generations, samples and seconds up to the first generation at `target` (None: not reached)."""
    hit = next((i for i, s in enumerate(successes) if s >= target), None)
    # Steady state: the first generation also pays one-time costs (thread pools, lazy imports).
    per_gen = (seconds[-1] - seconds[0]) / (len(seconds) - 1) if len(seconds) > 1 else float("nan")
    best = max(successes, default=float("nan"))
    out = {"reached": hit is not None, "generations": len(successes), "samples": None, "seconds": None,
           "s_per_generation": per_gen, "best": best, "curve": [round(s, 4) for s in successes]}
    if hit is not None:
        out |= {"generations": hit + 1, "samples": (hit + 1) * per_generation, "seconds": seconds[hit]}
    return out


def trl_available() -> bool:
    return importlib.util.find_spec("trl") is not None


def _side(argv: list[str]) -> dict[str, Any]:
    """Run one side in a fresh process (threads, compat patches and imports do not leak across)."""
    load = os.getloadavg()[0]  # other work on the machine slows the sides unequally: shown per side
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, __file__, *argv, "--result", f.name], env=env, cwd=ROOT,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
        return json.loads(Path(f.name).read_text()) | {"load": load}


def run_all(settings: tuple[Setting, ...] | list[Setting], variants: list[str], target: float, seeds: list[int],
            overrides: list[str] = (), trl_overrides: dict[str, Any] | None = None, trl: bool = True,
            train_pad_row: bool = False) -> list[dict[str, list[dict[str, Any]]]]:
    """Every side once per seed and setting: per setting, {side: [result per seed]}."""
    results: list[dict[str, list[dict[str, Any]]]] = [{} for _ in settings]
    trl = trl and trl_available()
    extra = [*(["--set", *overrides] if overrides else []), *(["--train-pad-row"] if train_pad_row else [])]
    with tempfile.TemporaryDirectory() as root:
        for seed in seeds:
            model = str(write_initial_model(Path(root) / str(seed), seed))  # the model depends on the seed only
            for k, setting in enumerate(settings):
                args = ["--setting", json.dumps(asdict(setting)), "--model", model, "--target", str(target),
                        "--seed", str(seed)]
                out = f"{root}/{seed}/{k}"
                if trl:
                    results[k].setdefault(TRL, []).append(_side(
                        ["--side", "trl", "--out", f"{out}/trl", *args, "--trl-set-json", json.dumps(trl_overrides or {})]))
                for v in variants:
                    results[k].setdefault(f"moe_rl ({v})", []).append(
                        _side(["--side", v, "--out", f"{out}/{v}", *args, *extra]))
    return results


def compare(settings: tuple[Setting, ...] | list[Setting] = PRESETS["demo"], variants: list[str] = list(VARIANTS),
            target: float = 0.8, seeds: list[int] = SEEDS, overrides: list[str] = (),
            trl_overrides: dict[str, Any] | None = None, json_out: str | None = None,
            train_pad_row: bool = False, trl: bool = True) -> str:
    """Both sides, one after the other, once per seed and setting, as a markdown section."""
    results = run_all(settings, variants, target, seeds, overrides, trl_overrides, trl, train_pad_row)
    if json_out:
        Path(json_out).write_text(json.dumps([{"setting": asdict(s), "seeds": seeds, "results": r}
                                              for s, r in zip(settings, results)], indent=1))
    notes = [f"moe_rl overrides: {' '.join(overrides)}"] if overrides else []
    notes += [f"TRL overrides: {trl_overrides}"] if trl_overrides else []
    notes += ["moe_rl trains HF's padding row (ablation)"] if train_pad_row else []
    return "\n\n".join(format_table(r, variants, target, seeds, s, notes) for s, r in zip(settings, results))


def _median(values: list[float | None]) -> float | None:
    """The median, a missing value (target not reached) counting as the largest; None if that is the median."""
    m = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(m) else m


def _ratios(ours: list[dict[str, Any]], trl: list[dict[str, Any]], key: str) -> list[float | None]:
    """Per seed, ours / TRL for `key` (None where either side missed the target)."""
    return [None if o[key] is None or t[key] is None else o[key] / t[key] for o, t in zip(ours, trl)]


def _reached(runs: list[dict[str, Any]], key: str) -> list[float | None]:
    return [r[key] if r["reached"] else None for r in runs]


def format_table(results: dict[str, list[dict[str, Any]]], variants: list[str], target: float,
                 seeds: list[int], setting: Setting = Setting(), notes: list[str] = ()) -> str:
    """One row per side, medians over the seeds; then the per-seed ratios against TRL and their medians."""
    fmt = lambda x, f: "not reached" if x is None else format(x, f)  # noqa: E731
    gens = lambda runs: ", ".join(str(r["generations"]) if r["reached"] else f"-({r['generations']})"  # noqa: E731
                                  for r in runs)
    rows = []
    for name, runs in results.items():
        reached = sum(r["reached"] for r in runs)
        rows.append((name, f"{reached}/{len(runs)}", fmt(_median(_reached(runs, "generations")), ".0f"), gens(runs),
                     fmt(_median([r["samples"] for r in runs]), ",.0f"), fmt(_median([r["seconds"] for r in runs]), ".1f"),
                     f"{statistics.median(r['best'] for r in runs):.2f}",
                     f"{statistics.median(r['s_per_generation'] for r in runs):.2f}",
                     f"{statistics.mean(r.get('load', math.nan) for r in runs):.1f}"))
    lines = [f"Task {setting.describe()}; target success {target}; seeds {', '.join(map(str, seeds))} "
             f"(medians over the seeds; a seed that missed counts as the largest; -(n): missed in n generations).",
             "", md_table(["side", f"reached {target}", f"generations to {target}", "per seed", f"samples to {target}",
                           f"s to {target}", "best success", "s / generation (after the 1st)", "load at start"], rows),
             ""]
    lines += [f"- moe_rl ({v}): {VARIANTS[v][0]}." for v in variants]
    lines += [f"- {n}." for n in notes]
    trl = results.get(TRL)
    if trl is None:
        lines.append("- TRL is not installed (`pip install -e \".[bench]\"`): moe_rl alone.")
        return "\n".join(lines)
    lines.append(f"- TRL {trl[0]['version']}, GRPOTrainer, importance_sampling_level=sequence, loss_type=grpo.")
    trl_gens = _median(_reached(trl, "generations"))
    for v in variants:
        ours = results[f"moe_rl ({v})"]
        time_r, samples, per_gen = (_ratios(ours, trl, k) for k in ("seconds", "samples", "s_per_generation"))
        ours_gens = _median(_reached(ours, "generations"))
        gen_ratio = None if ours_gens is None or trl_gens is None else ours_gens / trl_gens
        each = "; ".join(f"{seed}: {fmt(r, '.2f')}" for seed, r in zip(seeds, time_r))
        lines.append(f"- moe_rl ({v}) / TRL: median generations to {target} **{fmt(gen_ratio, '.2f')}**; "
                     f"median of the per-seed ratios: time to {target} **{fmt(_median(time_r), '.2f')}**, "
                     f"samples {fmt(_median(samples), '.2f')}, seconds per generation **{_median(per_gen):.2f}**. "
                     f"Time ratio per seed: {each}.")
    return "\n".join(lines)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def settings_from(a: argparse.Namespace) -> list[Setting]:
    """The preset's settings with the command line's changes (`--lr` x several: one setting each)."""
    out = []
    for base in PRESETS[a.preset]:
        changes = {k: getattr(a, k) for k in ("task", "samples", "new_tokens", "updates", "max_generations")
                   if getattr(a, k) is not None}
        lrs = a.lr or [base.lr]
        out += [replace(base, lr=lr, **changes) for lr in lrs]
    return list(dict.fromkeys(out))  # one preset setting per lr after `--lr`: keep each once


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=list(PRESETS), default="demo")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--task", help="toy task (add-easy, add-medium, add-hard, last-parity)")
    p.add_argument("--lr", type=float, nargs="+", help="Adam's constant learning rate (several: one run each)")
    p.add_argument("--samples", type=int, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, help="max new tokens per sample")
    p.add_argument("--updates", type=int, help="optimizer steps per generation")
    p.add_argument("--max-generations", type=int)
    p.add_argument("--seeds", type=int, nargs="+", default=SEEDS, help="one run of each side per seed")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="moe_rl overrides (every variant)")
    p.add_argument("--trl-set", nargs="*", default=[], metavar="KEY=VALUE", help="GRPOConfig fields for TRL")
    p.add_argument("--train-pad-row", action="store_true", help="ablation: moe_rl trains HF's padding row")
    p.add_argument("--json", help="also write every run's numbers and success curve to this file")
    p.add_argument("--no-trl", action="store_true", help="moe_rl alone (TRL's runs depend on the seed only)")
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--setting", help=argparse.SUPPRESS)
    p.add_argument("--trl-set-json", help=argparse.SUPPRESS)
    p.add_argument("--side", choices=["trl", *VARIANTS], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.side is None:
        trl_overrides = {k: _value(v) for k, v in (kv.split("=", 1) for kv in a.trl_set)}
        print(compare(settings_from(a), a.variants, a.target, a.seeds, a.set, trl_overrides, a.json, a.train_pad_row,
                      not a.no_trl))
        return
    setting = Setting(**json.loads(a.setting))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.side == "trl":
        res = run_trl(setting, a.model, a.out, a.target, a.seed, json.loads(a.trl_set_json or "{}"))
    else:
        res = run_moe_rl(a.side, setting, a.model, a.out, a.target, a.seed, a.set, a.train_pad_row)
    Path(a.result).write_text(json.dumps(res))


if __name__ == "__main__":
    main()
