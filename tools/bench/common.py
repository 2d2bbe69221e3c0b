"""Helpers the policy benchmarks share: model shapes, batches, the token loss, timing, memory.

Every benchmark builds its models from a `Shape` (a randomly initialised Qwen3-MoE
written as a HF checkpoint, nothing downloaded), builds its variants one after another
recording the peak memory each adds (`build_measured`), then times them interleaved
round by round (`interleave`) and reports paired ratios (`paired_ratio`).
"""
from __future__ import annotations

import ctypes
import gc
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Self

import torch

# Progress bars of every checkpoint save and load would bury the tables (spawned ranks inherit it).
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@dataclass(frozen=True)
class Shape:
    """A Qwen3-MoE shape (all layers MoE); field names follow `TinyMoEConfig`."""

    vocab_size: int = 2048
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    max_position_embeddings: int = 1024

    def with_(self, **changes: Any) -> Shape:
        return replace(self, **changes)

    @property
    def label(self) -> str:
        return (f"L={self.num_hidden_layers}, h={self.hidden_size}, E={self.num_experts} top-{self.num_experts_per_tok}, "
                f"ffn={self.moe_intermediate_size}, V={self.vocab_size}")

    def params(self, active: bool = False) -> int:
        """Parameter count (untied embeddings); `active`: only the top-k experts per token."""
        h, layers = self.hidden_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + 2 * self.head_dim  # q, k, v, o + q/k norms
        experts = self.num_experts_per_tok if active else self.num_experts
        mlp = experts * 3 * h * self.moe_intermediate_size + h * self.num_experts  # experts + router
        return layers * (attn + mlp + 2 * h) + 2 * self.vocab_size * h + h


# The model and batch the overhead and scaling tables share (their first rows).
BASE = Shape()
BASE_BATCH, BASE_SEQ, BASE_MICRO = 16, 128, 4


def write_model(root: str | Path, shape: Shape, seed: int = 0) -> str:
    """Write a randomly initialised model of `shape` under `root`; returns the HF directory."""
    from transformers.utils import logging

    from moe_rl.policy.tiny import TinyMoEConfig
    from moe_rl.testing import make_tiny_qwen3_moe

    logging.disable_progress_bar()  # transformers may have been imported before the variable was set
    name = "-".join(str(v) for v in asdict(shape).values())
    out = Path(root) / name
    if not (out / "config.json").exists():
        make_tiny_qwen3_moe(out, seed=seed, config=TinyMoEConfig(intermediate_size=4 * shape.hidden_size,
                                                                 **asdict(shape)))
    return str(out)


def read_vocab(hf_dir: str) -> int:
    import json

    return int(json.loads((Path(hf_dir) / "config.json").read_text())["vocab_size"])


def random_batch(n: int, seq: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (seq,), generator=g) for _ in range(n)]


def token_loss(global_tokens: int) -> Callable:
    """Mean negative log-likelihood over the global batch's tokens, as a `PolicyLoss`.

    Rows with `index < 0` are fillers the schedule adds; `loss_mask` drops padding.
    """

    def loss(logp: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, float]]:
        valid = (mb.index >= 0).float().unsqueeze(1).to(logp.device)
        value = -(logp * mb.loss_mask.to(logp.device) * valid).sum() / global_tokens
        return value, {"loss": float(value.detach())}

    return loss


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass
class Timings:
    """Seconds per call of each variant, in call order: wall clock and this process's CPU time.

    On a shared machine wall time swings with other people's load; CPU time counts only
    the work of this process (all its threads), so one-rank ratios stay steady under load.
    """

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]


def interleave(variants: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1) -> Timings:
    """Run the variants in turns, `rounds` times, so machine noise hits all of them alike."""
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    t = Timings({k: [] for k in variants}, {k: [] for k in variants})
    for _ in range(rounds):
        for name, fn in variants.items():
            sync()
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            sync()
            t.wall[name].append(time.perf_counter() - wall)
            t.cpu[name].append(time.process_time() - cpu)
    return t


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def paired_ratio(xs: Sequence[float], base: Sequence[float]) -> float:
    """Median of per-round ratios: each pair ran back to back, so slow phases of a shared
    machine cancel out of the ratio even when they move the medians."""
    return median([x / b for x, b in zip(xs, base)])


def ratio_spread(xs: Sequence[float], base: Sequence[float]) -> tuple[float, float]:
    """Interquartile range of the per-round ratios: how far one round's answer can be trusted."""
    ratios = [x / b for x, b in zip(xs, base)]
    if len(ratios) < 2:
        return (ratios[0], ratios[0]) if ratios else (float("nan"), float("nan"))
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return q[0], q[2]


def _status_kb(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def rss_mb() -> float:
    """Resident memory of this process now (MiB)."""
    kb = _status_kb("VmRSS")
    return kb / 1024 if kb is not None else float("nan")


def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:
        return None


@contextmanager
def returned_memory() -> Iterator[None]:
    """Inside the block, glibc hands freed blocks of 64 KiB and more straight back to the OS.

    Otherwise freed tensors stay in the heap and the next model reuses them unseen,
    and resident memory would not show what a variant needs. Free heap pages left
    from before are released on entry for the same reason. Afterwards the thresholds
    are set near what glibc's own adaptive ones reach, so timing runs as usual.
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)  # free heap pages left by earlier steps would hide the next variant's growth
        libc.mallopt(_M_MMAP_THRESHOLD, 64 << 10)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
            libc.mallopt(_M_TRIM_THRESHOLD, 64 << 20)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter ids (malloc.h)


class PeakAbove:
    """Peak memory while the block runs, above what the process held when it began (MiB).

    GPU: CUDA allocations. CPU: resident memory; the peak (VmHWM) is reset at the start
    through /proc/self/clear_refs. `ru_maxrss` cannot be reset, and in a spawned rank it
    even starts at the parent's size (Linux counts the pre-exec copy of the parent).
    """

    mb: float = float("nan")

    def __enter__(self) -> Self:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._before = torch.cuda.memory_allocated()
            return self
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._before = (_status_kb("VmRSS") or float("nan")) * 1024
        except OSError:
            self._before = float("nan")
        return self

    def __exit__(self, *exc: object) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            peak = float(torch.cuda.max_memory_allocated())
        else:
            peak = (_status_kb("VmHWM") or float("nan")) * 1024
        self.mb = (peak - self._before) / 2**20


def build_measured(builders: dict[Any, Callable[[], Callable[[], Any]]], steps: int = 2, warm_first: bool = True
                   ) -> tuple[dict[Any, Callable[[], Any]], dict[Any, float]]:
    """Build each variant and run it `steps` times, one after another, recording its peak memory.

    Returns the variants' step functions (warmed up by these steps) and the peak memory
    (MiB) each added while built and stepped: its weights, gradients, optimizer state
    (made on the first step) and the step's working memory. The first variant is first
    built, stepped and dropped once unmeasured: the first model in a process also pays
    one-time costs (lazy imports, communication buffers, thread pools) of ~30 MiB
    (`warm_first=False` skips this when the process already ran a model).
    """
    if warm_first:
        with returned_memory():
            fn = next(iter(builders.values()))()
            for _ in range(steps):
                fn()
            del fn
            gc.collect()
    fns: dict[Any, Callable[[], Any]] = {}
    mem: dict[Any, float] = {}
    for name, build in builders.items():
        with returned_memory(), PeakAbove() as peak:
            fn = build()
            for _ in range(steps):
                fn()
        fns[name], mem[name] = fn, peak.mb
    return fns, mem


def setup(layout: Any) -> None:
    """Create megatron's groups for `layout` once; later `Policy()` calls in this process reuse them."""
    from moe_rl.policy.parallel import init_distributed

    init_distributed(layout)


def make_policy(hf_dir: str, layout: Any = None, micro_batch_size: int = BASE_MICRO, **spec: Any) -> Any:
    from moe_rl.policy.parallel import ParallelLayout
    from moe_rl.policy.policy import Policy, PolicySpec
    from moe_rl.policy.train_step import OptimConfig

    return Policy(PolicySpec(hf_dir, layout or ParallelLayout(), OptimConfig(lr=1e-5), micro_batch_size=micro_batch_size,
                             **spec))


def layout_for(name: str) -> Any:
    """`ParallelLayout.parse(name)`: "single", "ep2", "tp2", "pp2", ... (world size = product)."""
    from moe_rl.policy.parallel import ParallelLayout

    return ParallelLayout.parse(name)


def shard(seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """This data-parallel rank's share of the global batch (contiguous block)."""
    from moe_rl.policy.parallel import data_parallel_rank_and_size

    rank, size = data_parallel_rank_and_size()
    per = len(seqs) // size
    return seqs[rank * per: (rank + 1) * per]


def md_table(head: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """Markdown table; `align` has one character per column, "l" or "r" (default: first left)."""
    align = align or "l" + "r" * (len(head) - 1)
    rule = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    lines = ["| " + " | ".join(head) + " |", rule]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


@contextmanager
def trainer_run(cfg_dict: dict[str, Any], out: str) -> Iterator[Any]:
    """This rank's `Run` (moe_rl/recipes/rl/run.py) of a config, built as `moe-rl train` builds it (`trainer.build_run`:
    policy, rollout engine or servers, weight sync); engine and servers are stopped on exit.
    Call on every rank of a `moe_rl.dist.spawn.run_ranks` job."""
    import torch.distributed as dist

    from moe_rl.config import RunConfig
    from moe_rl.recipes.build import build_run, cpu_threads_of

    cfg = RunConfig.from_dict(cfg_dict)
    rank = dist.get_rank()
    os.environ.setdefault("RANK", str(rank))
    torch.set_num_threads(cpu_threads_of(cfg)[0])  # as the trainer sets it
    built = build_run(cfg, Path(out), rank)
    run, servers = built["run"], built["servers"]
    try:
        yield run
    finally:
        if run.pipeline is not None:  # asynchronous runs: the batches asked for ahead are not needed
            run.pipeline.close()
        if run.engine is not None and hasattr(run.engine, "close"):
            run.engine.close()
        if servers is not None:
            servers.stop()
