"""`moe-rl drift`: routing volatility between two HF checkpoints on the same tokens.

    moe-rl drift --before A --after B --data rows.jsonl --out drift.json

Each JSONL row holds either `input_ids` (a list of token ids) or `prompt` and
`response` text, tokenised with the checkpoints' tokenizer (prompt with the
tokenizer's special tokens, response without, then concatenated, the way a
rollout appends generated tokens to its prompt). Both models run one
teacher-forced forward over every row; routes are compared at every position
but the last of each row (the positions that predict a next token), so
num_tokens = sum(len(row) - 1), as in SGLang's routed_experts.

The JSON report holds per-layer volatility and exact-match rates, the share of
tokens whose route changed in any layer, the log-prob gap between the two
models, and the change of the expert load; the same numbers as a table go to
stdout.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from moe_rl.drift.metrics import (LOAD_PREFIX, LOGPROB_PREFIX, VOLATILITY, LogprobStats, RouteStats,
                                  expert_load, load_change, logprob_mismatch, route_stats)
from moe_rl.drift.routes import RoutedForward, hf_forward, pad_right, router_modules
from moe_rl.routes import route_dtype

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
# Config fields two checkpoints must share for their routes to be comparable.
_ARCH_FIELDS = ("model_type", "num_hidden_layers", "num_experts", "num_experts_per_tok", "vocab_size")


class DriftError(RuntimeError):
    """A user-facing error of `moe-rl drift`: printed as one message, exit status 2."""


# ------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--before", required=True, metavar="DIR", help="HF checkpoint directory (reference)")
    parser.add_argument("--after", required=True, metavar="DIR", help="HF checkpoint directory to compare")
    parser.add_argument("--data", required=True, metavar="FILE.jsonl",
                        help="rows with `input_ids`, or `prompt` + `response` text; routes are compared at "
                             "positions 0..T-2 of each T-token row (every token that predicts a next one, as "
                             "SGLang's routed_experts cover a sequence), so the last token of a row is not scored")
    parser.add_argument("--out", required=True, metavar="FILE.json", help="where to write the JSON report")
    parser.add_argument("--batch-size", type=int, default=8, metavar="N", help="rows per forward (default 8)")
    parser.add_argument("--max-rows", type=int, default=None, metavar="N", help="read at most N rows")
    parser.add_argument("--device", default="cpu", help="torch device for both models (default cpu)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    out, err = Console(), Console(stderr=True)
    try:
        if args.batch_size < 1:
            raise DriftError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.max_rows is not None and args.max_rows < 1:
            raise DriftError(f"--max-rows must be >= 1, got {args.max_rows}")
        report = drift_report(args.before, args.after, args.data, batch_size=args.batch_size,
                              max_rows=args.max_rows, device=args.device, console=err)
        write_json(report, args.out)
    except DriftError as e:
        # plain print: rich would wrap a long path:line at the terminal width
        print(f"moe-rl drift: error: {e}", file=sys.stderr)
        return 2
    print_report(report, out)
    out.print(f"report written to {args.out}", highlight=False)
    return 0


def write_json(report: dict[str, Any], path: str | Path) -> None:
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(report, indent=2) + "\n")
    except OSError as e:
        raise DriftError(f"cannot write {str(p)!r}: {e.strerror or e}") from e


# ------------------------------------------------------------ checkpoints
def _num_experts(cfg: Any) -> int | None:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        n = getattr(cfg, name, None)
        if n:
            return int(n)
    return None


def _arch(cfg: Any) -> dict[str, Any]:
    """The routing-relevant architecture of a config (expert-count field names vary by model)."""
    facts = {f: getattr(cfg, f, None) for f in _ARCH_FIELDS}
    facts["num_experts"] = _num_experts(cfg)
    return facts


def load_config(path: str | Path, flag: str) -> Any:
    """The checkpoint's config; DriftError when `path` is not a HF checkpoint directory."""
    from transformers import AutoConfig

    p = Path(path)
    if not p.is_dir():
        raise DriftError(f"{flag} {str(p)!r}: checkpoint directory does not exist")
    if not (p / "config.json").is_file():
        raise DriftError(f"{flag} {str(p)!r}: not a HF checkpoint (no config.json)")
    try:
        return AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # unknown model_type, malformed JSON
        raise DriftError(f"{flag} {str(p)!r}: cannot read config.json: {e}") from e


def check_same_architecture(cfg_a: Any, cfg_b: Any) -> None:
    """Refuse checkpoints whose routes cannot be compared position by position."""
    a, b = _arch(cfg_a), _arch(cfg_b)
    diff = [f"{k}: {a[k]} vs {b[k]}" for k in a if a[k] != b[k]]
    if diff:
        raise DriftError("architecture mismatch between --before and --after (" + "; ".join(diff) + ")")
    if not a["num_experts"] or not a["num_experts_per_tok"]:
        raise DriftError(f"the checkpoints are not MoE models (model_type {a['model_type']!r} has no "
                         f"num_experts / num_experts_per_tok)")


def load_model(path: str | Path, flag: str, device: str) -> torch.nn.Module:
    """AutoModelForCausalLM in fp32 on `device`, eval mode; refuses a partially loaded checkpoint."""
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, local_files_only=True, output_loading_info=True)
    except Exception as e:
        raise DriftError(f"{flag} {str(path)!r}: cannot load the model: {type(e).__name__}: {e}") from e
    missing = list(info.get("missing_keys") or []) + list(info.get("mismatched_keys") or [])
    if missing:
        raise DriftError(f"{flag} {str(path)!r}: incomplete checkpoint, missing or mismatched weights "
                         f"{sorted(map(str, missing))[:5]}")
    try:
        return model.to(device).eval()
    except (RuntimeError, ValueError) as e:  # unknown or unavailable device
        raise DriftError(f"--device {device!r}: {e}") from e


def load_tokenizer(dirs: list[str]) -> Any:
    """The first checkpoint directory's tokenizer that has tokenizer files, else None."""
    from transformers import AutoTokenizer

    for d in dirs:
        # transformers 5 builds an empty tokenizer for a dir without tokenizer files: look first.
        if any((Path(d) / f).is_file() for f in _TOKENIZER_FILES):
            try:
                return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
            except Exception as e:
                raise DriftError(f"cannot load the tokenizer in {str(d)!r}: {e}") from e
    return None


# ------------------------------------------------------------------- data
@dataclass
class RowReader:
    """Turns JSONL rows into token lists; every error names `path:line`."""

    path: Path
    vocab_size: int
    max_positions: int | None
    tokenizer_dirs: list[str]
    _tokenizer: Any = field(default=None, init=False, repr=False)
    _tokenizer_tried: bool = field(default=False, init=False, repr=False)

    def tokenizer(self, where: str) -> Any:
        if not self._tokenizer_tried:
            self._tokenizer_tried = True
            self._tokenizer = load_tokenizer(self.tokenizer_dirs)
        if self._tokenizer is None:
            raise DriftError(f"{where}: the row holds text but the checkpoints have no tokenizer files; "
                             f"provide `input_ids` (a list of token ids) instead")
        return self._tokenizer

    def tokens(self, row: Any, where: str) -> list[int]:
        if not isinstance(row, dict):
            raise DriftError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        if "input_ids" in row:
            ids = row["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise DriftError(f"{where}: `input_ids` must be a list of integers")
        elif "prompt" in row and "response" in row:
            prompt, response = row["prompt"], row["response"]
            if not isinstance(prompt, str) or not isinstance(response, str):
                raise DriftError(f"{where}: `prompt` and `response` must be strings")
            tok = self.tokenizer(where)
            ids = list(tok(prompt)["input_ids"]) + list(tok(response, add_special_tokens=False)["input_ids"])
        else:
            raise DriftError(f"{where}: a row needs `input_ids`, or `prompt` and `response` "
                             f"(keys found: {sorted(row)})")
        return self._check(ids, where)

    def _check(self, ids: list[int], where: str) -> list[int]:
        if len(ids) < 2:
            raise DriftError(f"{where}: a row needs at least 2 tokens (routes are compared at every "
                             f"token but the last), got {len(ids)}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise DriftError(f"{where}: token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if self.max_positions and len(ids) > self.max_positions:
            raise DriftError(f"{where}: {len(ids)} tokens, the model takes at most {self.max_positions}")
        return ids

    def read(self, max_rows: int | None = None) -> list[list[int]]:
        """Token lists of the file's non-blank lines (the first `max_rows` of them)."""
        rows: list[list[int]] = []
        try:
            with self.path.open(encoding="utf-8") as f:
                for lineno, line in enumerate(f, start=1):
                    if max_rows is not None and len(rows) >= max_rows:
                        break
                    if line.strip():
                        rows.append(self.tokens(self._parse(line, f"{self.path}:{lineno}"),
                                                f"{self.path}:{lineno}"))
        except (OSError, UnicodeDecodeError) as e:
            raise DriftError(f"cannot read --data {str(self.path)!r}: {e}") from e
        if not rows:
            raise DriftError(f"{self.path}: no rows")
        return rows

    @staticmethod
    def _parse(line: str, where: str) -> Any:
        try:
            return json.loads(line)
        except json.JSONDecodeError as e:
            raise DriftError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from e


# ------------------------------------------------------------ comparison
@dataclass(eq=False)
class DriftTotals:
    """What one pass over the rows accumulates (sums and counts, see metrics.py)."""

    routes: RouteStats
    logprobs: LogprobStats
    load_before: torch.Tensor   # [L, E] int64
    load_after: torch.Tensor    # [L, E] int64

    def __add__(self, other: "DriftTotals") -> "DriftTotals":
        return DriftTotals(self.routes + other.routes, self.logprobs + other.logprobs,
                           self.load_before + other.load_before, self.load_after + other.load_after)


def _batches(rows: list[list[int]], batch_size: int) -> Iterator[list[list[int]]]:
    """Rows sorted by length, then cut into batches: less padding; the sums do not depend on order."""
    order = sorted(rows, key=len)
    for i in range(0, len(order), batch_size):
        yield order[i:i + batch_size]


def _batch_totals(a: RoutedForward, b: RoutedForward, num_experts: int) -> DriftTotals:
    """Statistics of one batch seen by both models (`a` before, `b` after)."""
    # Position t is counted when token t+1 is real: every token of a row but its last.
    keep = a.logprob_mask                                   # [B, T-1]
    dt = route_dtype(num_experts)                           # uint8 for <= 256 experts: 8x less memory
    ra = a.routes[:, :-1][keep].to(dt)                      # [n, L, K]
    rb = b.routes[:, :-1][keep].to(dt)
    return DriftTotals(
        routes=route_stats(ra, rb, num_experts=num_experts),
        logprobs=logprob_mismatch(b.logprobs, a.logprobs, keep),  # "train" = after, "rollout" = before
        load_before=expert_load(ra, num_experts),
        load_after=expert_load(rb, num_experts),
    )


def compare_models(before: torch.nn.Module, after: torch.nn.Module, rows: list[list[int]],
                   batch_size: int, num_experts: int, device: str = "cpu",
                   on_batch: Callable[[int], None] | None = None) -> DriftTotals:
    """Run both models over `rows` (token lists) and accumulate route, log-prob and load statistics.

    `on_batch(n_rows)` is called after each batch (progress display).
    """
    totals: DriftTotals | None = None
    for batch in _batches(rows, batch_size):
        ids, mask = (t.to(device) for t in pad_right(batch))   # [B, T] each
        part = _batch_totals(hf_forward(before, ids, mask), hf_forward(after, ids, mask), num_experts)
        totals = part if totals is None else totals + part
        if on_batch is not None:
            on_batch(len(batch))
    if totals is None:
        raise DriftError("no rows to compare")
    return totals


def _progress(console: Any) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("routes"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
                    TimeRemainingColumn(), console=console, transient=True)


def drift_report(before: str, after: str, data: str, batch_size: int = 8, max_rows: int | None = None,
                 device: str = "cpu", console: Any = None) -> dict[str, Any]:
    """Everything `moe-rl drift` computes, as the JSON-ready report dict."""
    cfg_a, cfg_b = load_config(before, "--before"), load_config(after, "--after")
    check_same_architecture(cfg_a, cfg_b)
    data_path = Path(data)
    if not data_path.is_file():
        raise DriftError(f"--data {data!r}: file does not exist")
    reader = RowReader(data_path, int(cfg_a.vocab_size),
                       getattr(cfg_a, "max_position_embeddings", None), [before, after])
    rows = reader.read(max_rows)
    model_a, model_b = load_model(before, "--before", device), load_model(after, "--after", device)
    layers_a = [i for i, _ in router_modules(model_a)]
    layers_b = [i for i, _ in router_modules(model_b)]
    if layers_a != layers_b:
        raise DriftError(f"architecture mismatch: MoE layers {layers_a} in --before, {layers_b} in --after")
    E = int(_num_experts(cfg_a))
    with _progress(console) as progress:
        task = progress.add_task("rows", total=len(rows))
        totals = compare_models(model_a, model_b, rows, batch_size, E, device,
                                on_batch=lambda n: progress.advance(task, n))
    return build_report(totals, layers_a, before=before, after=after, data=data, num_rows=len(rows))


def _finite(x: float) -> float | None:
    """JSON has no NaN: a rate without tokens is written as null."""
    return x if math.isfinite(x) else None


def build_report(t: DriftTotals, layer_ids: list[int], **meta: Any) -> dict[str, Any]:
    """The JSON report: headline numbers, one object per MoE layer, and the flat metric dict."""
    vol = t.routes.summary(VOLATILITY, layer_ids)
    lp = t.logprobs.summary(LOGPROB_PREFIX)
    load = load_change(t.load_before, t.load_after, layer_ids, LOAD_PREFIX)
    share_b = (t.load_before.double() / t.load_before.sum(-1, keepdim=True)).amax(-1).tolist()
    share_a = (t.load_after.double() / t.load_after.sum(-1, keepdim=True)).amax(-1).tolist()
    layers = [{"layer": lid, "volatility": _finite(row["volatility"]),
               "exact_match": _finite(row["exact_match"]),
               "load_change": _finite(load[f"{LOAD_PREFIX}_change/layer_{lid:02d}"]),
               "max_share_before": _finite(share_b[i]), "max_share_after": _finite(share_a[i])}
              for i, (lid, row) in enumerate(zip(layer_ids, t.routes.per_layer()))]
    return {
        **meta,
        "num_tokens": int(t.routes.num_tokens),
        "num_layers": len(layer_ids),
        "num_experts": int(t.load_before.shape[1]),
        "topk": t.routes.topk,
        "volatility": _finite(vol[VOLATILITY]),
        "exact_match": _finite(vol[f"{VOLATILITY}/exact_match"]),
        "tokens_changed_any_layer": _finite(vol[f"{VOLATILITY}/tokens_changed_any_layer"]),
        "layers": layers,
        "logprob": {
            "k3": _finite(lp[f"{LOGPROB_PREFIX}_k3"]),
            "abs_diff": _finite(lp[f"{LOGPROB_PREFIX}_abs_diff"]),
            "ratio_outside": _finite(lp[f"{LOGPROB_PREFIX}_ratio_outside"]),
            "definition": "d = log p_after - log p_before per token; k3 = mean(exp(d) - 1 - d) estimates "
                          "KL(before || after) on tokens sampled from before; ratio_outside: share of "
                          "tokens with p_after / p_before outside [1/2, 2]",
        },
        "load_change": _finite(load[f"{LOAD_PREFIX}_change"]),
        "load_max_share": _finite(load[f"{LOAD_PREFIX}_max_share"]),
        "load": {"before": t.load_before.tolist(), "after": t.load_after.tolist()},
        "metrics": {k: _finite(v) for k, v in {**vol, **lp, **load}.items()},
    }


# ------------------------------------------------------------------ table
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def print_report(report: dict[str, Any], console: Any) -> None:
    """Per-layer table plus the headline numbers, for a terminal."""
    from rich.table import Table

    console.print(f"before: {report['before']}\nafter:  {report['after']}\ndata:   {report['data']} "
                  f"({report['num_rows']} rows, {report['num_tokens']} tokens)", highlight=False, soft_wrap=True)
    table = Table(title=f"routing drift, top-{report['topk']} of {report['num_experts']} experts")
    for col in ("layer", "volatility", "exact match", "load change (TV)", "max expert share"):
        table.add_column(col, justify="right")
    for row in report["layers"]:
        table.add_row(str(row["layer"]), _pct(row["volatility"]), _pct(row["exact_match"]),
                      _pct(row["load_change"]),
                      f"{_pct(row['max_share_before'])} -> {_pct(row['max_share_after'])}")
    table.add_section()
    table.add_row("all", _pct(report["volatility"]), _pct(report["exact_match"]),
                  _pct(report["load_change"]), f"max {_pct(report['load_max_share'])}", style="bold")
    console.print(table)
    lp = report["logprob"]
    fmt = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
    console.print(f"tokens whose route changed in any layer: {_pct(report['tokens_changed_any_layer'])}\n"
                  f"log-prob after vs before: k3 KL {fmt(lp['k3'])}, mean |Δ log p| {fmt(lp['abs_diff'])}, "
                  f"ratio outside [1/2, 2] {_pct(lp['ratio_outside'])}", highlight=False)
