"""`moe-rl export`: a HF checkpoint (safetensors, `config.json`, the source model's tokenizer) from a
run's checkpoint, whatever layout wrote it.

    moe-rl export --checkpoint RUN/checkpoints/step_N --out DIR [--dtype bf16] [--peft]

The policy's megatron distributed checkpoint (`step_N/policy/`) is read resharded into one process
on CPU, then written with the trainer's own HF exporter (the weight map weight sync uses). The
source model, for the architecture and the tokenizer, is the run's: `RUN/init_model/` (the tiny
model a run without `model.hf_path` wrote) or `model.hf_path` of `RUN/config.yaml`. RL, critic-
bearing and DPO checkpoints alike: the critic is left out. A LoRA run's (`model.lora.rank` > 0)
is written merged, W + alpha / rank * B A, a plain HF model.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from moe_rl.config import ConfigError, load_config
from moe_rl.train.integrity import not_a_checkpoint

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# what a HF tokenizer (and generation defaults) is made of, copied next to the weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")


class ExportError(ValueError):
    """A checkpoint or destination export cannot use."""


def source_model(checkpoint: Path) -> tuple[Path, Any]:
    """The HF checkpoint the run started from (architecture, tokenizer) and its config's `model`
    section (the dtype it trained in, its LoRA settings)."""
    run_dir = checkpoint.parent.parent
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ExportError(f"{config} is missing: --checkpoint must be RUN/checkpoints/step_N of a moe-rl run")
    model = load_config(config).model
    if (run_dir / "init_model" / "config.json").is_file():
        return run_dir / "init_model", model
    if not model.hf_path or not (Path(model.hf_path) / "config.json").is_file():
        raise ExportError(f"{config}: model.hf_path {model.hf_path!r} is not a HF checkpoint directory on this machine")
    return Path(model.hf_path), model


def export_policy(policy_dir: Path, source: Path, out: Path, dtype: str | None = None,
                  trained_dtype: str = "fp32", lora: Any = None, peft: bool = False) -> Path:
    """Write the model of the distributed checkpoint `policy_dir` (any layout; parameters in
    `trained_dtype`) as a HF checkpoint in `out`, on one local process; `dtype`: cast on the way.
    `lora`: the run's `LoraSpec` (its checkpoint holds adapters; the export is the merged model, or with
    `peft` the adapter in PEFT's format)."""
    from moe_rl.dist.spawn import run_ranks

    run_ranks(_export_rank, 1, str(policy_dir), str(source), str(out), dtype, trained_dtype, lora, peft,
              timeout=3600)
    if peft:
        return out
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    return out


def _export_rank(policy_dir: str, source: str, out: str, dtype: str | None, trained_dtype: str,
                 lora: Any = None, peft: bool = False) -> None:
    import torch

    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig

    policy = Policy(PolicySpec(hf_dir=source, layout=ParallelLayout.parse("single"), optim=OptimConfig(lr=1e-6),
                               dtype=trained_dtype, lora=lora))
    policy.load_sharded(policy_dir, weights_only=True)
    if peft:
        policy.export_peft(out)
        return
    policy.export_hf(out, dtype=None if dtype is None else getattr(torch, DTYPES[dtype]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="RUN/checkpoints/step_N",
                        help="a finished checkpoint of any layout (its policy/ directory is read)")
    parser.add_argument("--out", required=True, metavar="DIR", help="where to write the HF checkpoint (new or empty)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="cast the weights (default: as trained, the policy's parameter dtype)")
    parser.add_argument("--peft", action="store_true",
                        help="a LoRA run (model.lora.rank > 0): write the adapter in PEFT's format "
                             "(adapter_config.json + adapter_model.safetensors, for peft.PeftModel.from_pretrained "
                             "on the base model) instead of the merged model")


def run(args: argparse.Namespace) -> int:
    ckpt, out = Path(args.checkpoint), Path(args.out)
    try:
        if why := not_a_checkpoint(ckpt):
            raise ExportError(why)
        if not (ckpt / "policy").is_dir():
            raise ExportError(f"{ckpt} has no policy/ directory: it is in the per-rank format of earlier versions; "
                              "resume it once (train.resume=...) and export the checkpoint that run writes")
        if out.exists() and any(out.iterdir()):
            raise ExportError(f"--out {out} is not empty")
        source, model = source_model(ckpt)
        if args.peft and not model.lora.rank:
            raise ExportError(f"--peft: {ckpt} is of a full-parameter run (model.lora.rank=0); it has no adapter")
    except (ExportError, ConfigError) as e:
        print(f"moe-rl export: {e}", file=sys.stderr)
        return 2
    from moe_rl.policy.lora import LoraSpec

    export_policy(ckpt / "policy", source, out, args.dtype, model.dtype, LoraSpec.of(model), args.peft)
    print(f"wrote {out} (from {ckpt}, {'the PEFT adapter of the base' if args.peft else 'model and tokenizer of'} "
          f"{source})")
    return 0
