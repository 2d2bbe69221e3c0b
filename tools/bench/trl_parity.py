"""Time and samples to a success rate, moe_rl against TRL's GRPOTrainer, same task and CPU.

Both train the same freshly initialised tiny Qwen3-MoE (4 layers, hidden 64, 8 experts
top-2; one checkpoint written once by `moe_rl.testing.make_tiny_qwen3_moe`) from scratch with
the demo's run (launch/configs/tiny_cpu.yaml): `toy:add-easy` (a+b, 9 prompts), 9 prompts x
16 samples of 1 new token at temperature 1, 2 optimizer steps of 72 samples per generation,
GSPO with the paper's clip range (3e-4, 4e-4), no KL, group-normalised advantages, Adam at a
constant lr 1e-3, gradient clipping at 1.0. The reward is moe_rl's toy exact match. Both
sides reach 0.8 there, in 30-45 generations. In the other settings tried (2 new tokens, where
the answer must end with `<eos>`: chance 1/256; add-medium; lr 3e-3 or 1e-2) at most one side
reached 0.8 within 60-120 generations (README, "Small runs").

- TRL: `GRPOTrainer` with `importance_sampling_level="sequence"`, `loss_type="grpo"`
  (per-sequence mean, as moe_rl's GSPO), generation by transformers in the same process.
- moe_rl: `rl_step` as `moe-rl train` runs it, in the variants of `VARIANTS`.

Each side runs in its own process, one after the other, in one invocation. Reported per
side: the first generation whose batch success rate (share of samples with reward 1)
reaches the target, the samples generated up to it, and the training seconds up to it
(TRL: from the start of training to the log of that generation's rewards; moe_rl: the
summed `perf/step_s` of the steps up to it; model building and imports excluded on both
sides), and the seconds per generation after the first (the steady rate, whether or not the
target is reached). TRL is an optional dependency (`pip install -e ".[bench]"`); without it the
section says so and reports moe_rl alone.

    python tools/bench/trl_parity.py
    python tools/bench/trl_parity.py --variants fast --task add-medium --lr 3e-3 --max-generations 80
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import md_table

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "launch" / "configs" / "tiny_cpu.yaml"
# The run's settings (`--task`, `--lr`, ...; passed to the sides' processes in the environment).
# The defaults are the demo's run (launch/configs/tiny_cpu.yaml), which both sides learn.
DEFAULTS = {"task": "add-easy", "lr": 1e-3, "samples": 16, "new_tokens": 1, "updates": 2}
SETTINGS = DEFAULTS | json.loads(os.environ.get("MOE_RL_PARITY", "{}"))
TASK, LR, SAMPLES, NEW_TOKENS, UPDATES = (SETTINGS[k] for k in ("task", "lr", "samples", "new_tokens", "updates"))
TRL = "TRL GRPOTrainer"  # the TRL side's row
SEEDS = [1234, 1235, 1236]  # each seed: a fresh model, sampler order and sampling noise for both sides


def _prompts_per_step(task: str) -> int:
    from moe_rl.data.toy import make_toy_examples

    return min(32, len(make_toy_examples(task)))


PROMPTS = _prompts_per_step(TASK)
EPS_LOW, EPS_HIGH = 3e-4, 4e-4  # the GSPO paper's clip range (moe_rl's GSPO default)


def common(seed: int) -> list[str]:
    """The run both sides share, as moe_rl config overrides on the demo config."""
    return [f"data.train=toy:{TASK}", "data.eval=null", f"data.prompts_per_step={PROMPTS}",
            f"rollout.n_samples={SAMPLES}", f"rollout.max_new_tokens={NEW_TOKENS}", "rollout.temperature=1.0",
            "algo.loss=gspo", "algo.advantage=grpo", f"algo.num_minibatches={UPDATES}",
            f"algo.eps_low={EPS_LOW}", f"algo.eps_high={EPS_HIGH}", f"train.lr={LR}", "train.lr_schedule=constant",
            "train.grad_clip=1.0", "train.eval_every=0", "train.save_every=0", "model.tiny.num_experts=8",
            "model.tiny.num_experts_per_tok=2", f"model.seed={seed}", "log.progress=false", "log.tensorboard=false"]


# moe_rl's variants: how it runs, each a list of overrides on top of `common`.
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "fast": ("1 process, engine in-process, tensor weight sync, no drift, no replay, one padded micro-batch per update",
             ["train.world_size=1", "parallel.ep=1", "rollout.engine=inprocess", "rollout.weight_sync=tensor",
              "rollout.return_routed_experts=false", "drift.enabled=false", "algo.replay=off",
              "parallel.max_tokens_per_microbatch=null", "parallel.micro_batch_size=256"]),
    "demo": ("the demo's layout: 2 ranks EP2, `moe-rl serve` over HTTP, disk weight sync, R2, drift every 5th step",
             []),
}


# ---------------------------------------------------------------- the shared model

def write_initial_model(out: Path, seed: int) -> Path:
    """The fresh tiny Qwen3-MoE both sides start from (the checkpoint `moe-rl train` would write)."""
    from moe_rl.config import load_config
    from moe_rl.data.dataset import load_dataset
    from moe_rl.trainer import initial_model

    cfg = load_config(str(DEMO), common(seed))
    return initial_model(cfg, out, 0, load_dataset(cfg.data.train, None))


# ---------------------------------------------------------------- moe_rl

def moe_rl_rank(cfg_dict: dict[str, Any], out: str, target: float, max_steps: int) -> list[dict[str, float]]:
    """One rank: RL steps until the batch success rate reaches `target` (every rank sees the same
    metrics, so all stop together); per step: success rate and seconds."""
    from common import trainer_run
    from moe_rl.loop import rl_step

    rows = []
    with trainer_run(cfg_dict, out) as run:
        for step in range(1, max_steps + 1):
            m = rl_step(run, step)
            rows.append({"success": m["reward/success_rate"], "step_s": m["perf/step_s"]})
            if m["reward/success_rate"] >= target:
                break
    return rows


def run_moe_rl(variant: str, model_dir: str, out: str, target: float, max_steps: int, seed: int) -> dict[str, Any]:
    from moe_rl.config import load_config
    from moe_rl.spawn import run_ranks

    cfg = load_config(str(DEMO), common(seed) + VARIANTS[variant][1] + [f"model.hf_path={model_dir}",
                                                                        f"log.run_dir={out}"])
    rows = run_ranks(moe_rl_rank, cfg.train.world_size, cfg.to_dict(), out, target, max_steps, timeout=1800)[0]
    return summarise([r["success"] for r in rows], [sum(r["step_s"] for r in rows[: i + 1]) for i in range(len(rows))],
                     target)


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


def run_trl(model_dir: str, out: str, target: float, max_generations: int, seed: int) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from moe_rl.data.toy import make_toy_examples

    torch.manual_seed(seed)
    tokenizer = toy_hf_tokenizer()
    data = Dataset.from_list([{"prompt": "<bos>" + ex.prompt_text, "answer": ex.answer}
                              for ex in make_toy_examples(TASK)])
    args = GRPOConfig(
        output_dir=out, per_device_train_batch_size=PROMPTS * SAMPLES // UPDATES, steps_per_generation=UPDATES,
        num_generations=SAMPLES, max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0,
        importance_sampling_level="sequence", loss_type="grpo", epsilon=EPS_LOW, epsilon_high=EPS_HIGH, beta=0.0,
        scale_rewards="group", learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        max_steps=UPDATES * max_generations, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, seed=seed, disable_tqdm=True, dataloader_num_workers=0)
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

    return summarise(successes, seconds, target) | {"version": trl.__version__}


# ---------------------------------------------------------------- the comparison

def summarise(successes: list[float], seconds: list[float], target: float) -> dict[str, Any]:
    """Generations, samples and seconds up to the first generation at `target` (None: not reached)."""
    hit = next((i for i, s in enumerate(successes) if s >= target), None)
    # Steady state: the first generation also pays one-time costs (thread pools, lazy imports).
    per_gen = (seconds[-1] - seconds[0]) / (len(seconds) - 1) if len(seconds) > 1 else float("nan")
    best = max(successes, default=float("nan"))
    if hit is None:
        return {"reached": False, "generations": len(successes), "samples": None, "seconds": None,
                "s_per_generation": per_gen, "best": best}
    return {"reached": True, "generations": hit + 1, "samples": (hit + 1) * PROMPTS * SAMPLES,
            "seconds": seconds[hit], "s_per_generation": per_gen, "best": best}


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


def compare(variants: list[str] = list(VARIANTS), target: float = 0.8, max_generations: int = 150,
            seeds: list[int] = SEEDS) -> str:
    """Both sides, one after the other, once per seed, as a markdown section."""
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as root:
        for seed in seeds:
            model = str(write_initial_model(Path(root) / str(seed), seed))
            args = ["--model", model, "--target", str(target), "--max-generations", str(max_generations),
                    "--seed", str(seed)]
            if trl_available():
                results.setdefault(TRL, []).append(_side(["--side", "trl", "--out", f"{root}/{seed}/trl", *args]))
            for v in variants:
                results.setdefault(f"moe_rl ({v})", []).append(
                    _side(["--side", v, "--out", f"{root}/{seed}/{v}", *args]))
    return format_table(results, variants, target, seeds)


def _median(values: list[float | None]) -> float | None:
    """The median, a missing value (target not reached) counting as the largest; None if that is the median."""
    m = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(m) else m


def _ratios(ours: list[dict[str, Any]], trl: list[dict[str, Any]], key: str) -> list[float | None]:
    """Per seed, ours / TRL for `key` (None where either side missed the target)."""
    return [None if o[key] is None or t[key] is None else o[key] / t[key] for o, t in zip(ours, trl)]


def format_table(results: dict[str, list[dict[str, Any]]], variants: list[str], target: float,
                 seeds: list[int]) -> str:
    """One row per side, medians over the seeds; then the per-seed ratios against TRL and their medians."""
    fmt = lambda x, f: "not reached" if x is None else format(x, f)  # noqa: E731
    rows = []
    for name, runs in results.items():
        reached = sum(r["reached"] for r in runs)
        rows.append((name, f"{reached}/{len(runs)}", fmt(_median([r["seconds"] for r in runs]), ".1f"),
                     fmt(_median([r["samples"] for r in runs]), ",.0f"),
                     fmt(_median([r["generations"] if r["reached"] else None for r in runs]), ".0f"),
                     f"{statistics.median(r['best'] for r in runs):.2f}",
                     f"{statistics.median(r['s_per_generation'] for r in runs):.2f}",
                     f"{statistics.mean(r.get('load', math.nan) for r in runs):.1f}"))
    lines = [f"Task toy:{TASK}, {PROMPTS} prompts x {SAMPLES} samples, {NEW_TOKENS} new tokens, {UPDATES} "
             f"updates per generation, GSPO eps ({EPS_LOW}, {EPS_HIGH}), lr {LR}; target success {target}; "
             f"seeds {', '.join(map(str, seeds))} (medians over the seeds).", "",
             md_table(["side", f"reached {target}", f"s to {target}", f"samples to {target}", "generations",
                       "best success", "s / generation (after the 1st)", "load at start"], rows), ""]
    lines += [f"- moe_rl ({v}): {VARIANTS[v][0]}." for v in variants]
    trl = results.get(TRL)
    if trl is None:
        lines.append("- TRL is not installed (`pip install -e \".[bench]\"`): moe_rl alone.")
        return "\n".join(lines)
    lines.append(f"- TRL {trl[0]['version']}, GRPOTrainer, importance_sampling_level=sequence, loss_type=grpo.")
    for v in variants:
        ours = results[f"moe_rl ({v})"]
        time, samples, per_gen = (_ratios(ours, trl, k) for k in ("seconds", "samples", "s_per_generation"))
        each = "; ".join(f"{seed}: {fmt(r, '.2f')}" for seed, r in zip(seeds, time))
        lines.append(f"- moe_rl ({v}) / TRL, median of the per-seed ratios: time to {target} "
                     f"**{fmt(_median(time), '.2f')}**; samples {fmt(_median(samples), '.2f')}; seconds per "
                     f"generation **{_median(per_gen):.2f}**. Time ratio per seed: {each}.")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--task", default=TASK, help="toy task (add-easy, add-medium, add-hard)")
    p.add_argument("--lr", type=float, default=LR, help="Adam's constant learning rate")
    p.add_argument("--samples", type=int, default=SAMPLES, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="max new tokens per sample")
    p.add_argument("--updates", type=int, default=UPDATES, help="optimizer steps per generation")
    p.add_argument("--max-generations", type=int, default=150)
    p.add_argument("--seeds", type=int, nargs="+", default=SEEDS, help="one run of each side per seed")
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--side", choices=["trl", *VARIANTS], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    wanted = {k: getattr(a, k) for k in DEFAULTS}
    if wanted != SETTINGS:  # the constants above follow the settings: start again with them set
        os.environ["MOE_RL_PARITY"] = json.dumps(wanted)
        os.execv(sys.executable, [sys.executable, __file__, *sys.argv[1:]])
    if a.side is None:
        print(compare(a.variants, a.target, a.max_generations, a.seeds))
        return
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.side == "trl":
        res = run_trl(a.model, a.out, a.target, a.max_generations, a.seed)
    else:
        res = run_moe_rl(a.side, a.model, a.out, a.target, a.max_generations, a.seed)
    Path(a.result).write_text(json.dumps(res))


if __name__ == "__main__":
    main()
