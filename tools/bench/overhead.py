"""Framework overhead: one moe_rl update step against bare megatron-core on the same model.

Both sides train the same GPTModel (built by `moe_rl.policy.model.build_model`, the
same HF weights loaded), wrapped in megatron DDP and megatron's Adam, on the same
batch and layout, with the same loss: the mean next-token NLL over the batch.

- moe_rl: `Policy.update(seqs, {}, loss)`: microbatches built from the sequence
  list, log-probs from the logits (`PolicyLoss`), the schedule, gradient reduction,
  clipping, the optimizer and LR scheduler steps, metrics.
- bare:   what a hand-written megatron loop does with pre-built tensors:
  `get_forward_backward_func()` with a forward_step whose loss is
  `vocab_parallel_cross_entropy(logits, labels)` masked and summed, then
  `finalize_model_grads` and `optimizer.step()`.

Both live in one process per rank. Each is first built and stepped twice on its own,
which records the peak memory it adds (`common.build_measured`) and warms it up;
then they alternate round by round, and "× bare" is the median of the per-round
ratios moe_rl / bare (target: at most 1.10). The two sides start from the same
weights and take the same steps, so their losses must agree: the table says how
closely. The breakdown splits each step into the time inside megatron's schedule
and the rest, which is where moe_rl's own Python (batching, metrics) shows; its
log-prob path (an fp32 copy of the logits) sits inside the schedule.

    python tools/bench/overhead.py                     # 1 rank, then EP2 on 2 gloo ranks
    python tools/bench/overhead.py --worlds 1 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import BASE, BASE_BATCH, BASE_MICRO, BASE_SEQ, Shape

LAYOUT_OF_WORLD = {1: "single", 2: "ep2"}


def bare_model(hf_dir: str, layout: Any, dtype: str = "fp32") -> tuple[list[Any], Any]:
    """The policy's GPTModel with the same weights, in megatron DDP + Adam (same settings as Policy)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from moe_rl.policy.convert import load_hf_weights
    from moe_rl.policy.model import build_model, read_hf_config
    from moe_rl.policy.train_step import OptimConfig, wrap_ddp

    arch = read_hf_config(hf_dir)
    chunks = build_model(arch, layout, dtype)
    load_hf_weights(chunks, hf_dir, arch)
    ddp = wrap_ddp(chunks)
    o, cfg = OptimConfig(lr=1e-5), chunks[0].config
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.grad_clip, bf16=cfg.bf16, fp16=cfg.fp16,
        params_dtype=cfg.params_dtype), ddp)
    return ddp, opt


class BareStep:
    """One update of `chunks` on fixed-length `seqs`, written directly against megatron-core."""

    def __init__(self, chunks: list[Any], optimizer: Any, seqs: list[torch.Tensor], micro: int,
                 global_tokens: int) -> None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        tokens = torch.stack(seqs).to(device)
        labels = torch.roll(tokens, -1, dims=1)  # position t predicts token t + 1 ...
        mask = torch.ones_like(tokens, dtype=torch.float32)
        mask[:, -1] = 0  # ... except the last, which has no next token
        self.data = [(tokens[i: i + micro], labels[i: i + micro], mask[i: i + micro])
                     for i in range(0, len(seqs), micro)]
        self.positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand(micro, -1)
        self.chunks, self.optimizer, self.norm = chunks, optimizer, float(global_tokens)

    def __call__(self) -> float:
        from megatron.core import pipeline_parallel, tensor_parallel
        from megatron.core.distributed import finalize_model_grads

        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()

        def forward_step(data: Any, model: Any) -> tuple[torch.Tensor, Any]:
            tokens, labels, mask = next(data)
            logits = model(tokens, self.positions, attention_mask=None)

            def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
                nll = tensor_parallel.vocab_parallel_cross_entropy(out.float(), labels)
                loss = (nll * mask).sum() / self.norm
                return loss, torch.ones((), dtype=torch.int), {"loss": loss.detach()}

            return logits, loss_func

        tokens = self.data[0][0]
        out = pipeline_parallel.get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(self.data), model=self.chunks[0],
            num_microbatches=len(self.data), seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0],
            forward_only=False)
        finalize_model_grads(self.chunks)
        self.optimizer.step()
        return float(sum(float(o["loss"]) for o in out))


class ScheduleClock:
    """CPU seconds spent inside megatron's forward-backward schedule, by whoever calls it.

    Wraps `megatron.core.pipeline_parallel.get_forward_backward_func`, which moe_rl and
    `BareStep` both look up at call time.
    """

    def __init__(self) -> None:
        import megatron.core.pipeline_parallel as pp

        self.seconds = 0.0
        original = pp.get_forward_backward_func

        def get() -> Any:
            fb = original()

            def timed(**kwargs: Any) -> Any:
                common.sync()
                start = time.process_time()
                try:
                    return fb(**kwargs)
                finally:
                    common.sync()
                    self.seconds += time.process_time() - start

            return timed

        pp.get_forward_backward_func = get


def _builders(hf_dir: str, layout: Any, batch: int, seq: int, micro: int,
              losses: dict[str, list[float]]) -> dict[str, Any]:
    """Step-function factories of both sides; each step appends its loss to `losses`."""
    common.setup(layout)
    seqs = common.shard(common.random_batch(batch, seq, common.read_vocab(hf_dir)))
    tokens = batch * (seq - 1)

    def bare() -> Any:
        step = BareStep(*bare_model(hf_dir, layout), seqs, micro, tokens)
        return lambda: losses["bare"].append(step())

    def moe_rl() -> Any:
        policy, loss = common.make_policy(hf_dir, layout, micro), common.token_loss(tokens)
        return lambda: losses["moe_rl"].append(sum(m["loss"] for m in policy.update(seqs, {}, loss).microbatches))

    return {"bare": bare, "moe_rl": moe_rl}


def _worker(hf_dir: str, batch: int, seq: int, micro: int, rounds: int) -> dict[str, Any]:
    layout = common.layout_for(LAYOUT_OF_WORLD[int(os.environ.get("WORLD_SIZE", "1"))])
    losses: dict[str, list[float]] = {"bare": [], "moe_rl": []}
    builders = _builders(hf_dir, layout, batch, seq, micro, losses)
    base = common.rss_mb()
    fns, mem = common.build_measured(builders)  # also the warm-up
    for v in losses.values():  # compare the timed steps only (the unmeasured first build stepped too)
        v.clear()
    clock = ScheduleClock()
    schedule: dict[str, list[float]] = {k: [] for k in fns}

    def timed(name: str) -> Any:
        def call() -> None:
            clock.seconds = 0.0
            fns[name]()
            schedule[name].append(clock.seconds)
        return call

    t = common.interleave({k: timed(k) for k in fns}, rounds, warmup=0)
    diff = max(abs(a - b) for a, b in zip(losses["moe_rl"], losses["bare"]))
    return {"wall": t.wall, "cpu": t.cpu, "schedule": schedule, "loss_diff": diff, "mem": mem, "base_mb": base,
            "load": os.getloadavg()[0]}


def bench_rows(rounds: int = 10, worlds: tuple[int, ...] = (1, 2), shape: Shape = BASE,
               batch: int = BASE_BATCH, seq: int = BASE_SEQ, micro: int = BASE_MICRO) -> list[dict[str, Any]]:
    """Rows `{layout, variant, median_s, ratio, schedule_s, mem_mb, base_mb, loss_diff, ...}`, bare first.

    `ratio` is the median of per-round ratios to bare; `mem_mb` the largest over ranks.
    """
    from moe_rl.testing import run_ranks

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = common.write_model(tmp, shape)
        for world in worlds:
            res = run_ranks(_worker, world, hf, batch, seq, micro, rounds, timeout=1800)
            wall, cpu = res[0]["wall"], res[0]["cpu"]
            for variant in ("bare", "moe_rl"):
                rows.append({
                    "layout": LAYOUT_OF_WORLD[world], "world": world, "variant": variant,
                    "median_s": common.median(wall[variant]), "ratio": common.paired_ratio(wall[variant], wall["bare"]),
                    "cpu_s": common.median(cpu[variant]), "cpu_ratio": common.paired_ratio(cpu[variant], cpu["bare"]),
                    "cpu_iqr": common.ratio_spread(cpu[variant], cpu["bare"]),
                    "schedule_s": common.median(res[0]["schedule"][variant]), "load": res[0]["load"],
                    "outside_s": common.median([c - s for c, s in zip(cpu[variant], res[0]["schedule"][variant])]),
                    "mem_mb": max(r["mem"][variant] for r in res), "base_mb": max(r["base_mb"] for r in res),
                    "loss_diff": res[0]["loss_diff"], "shape": shape, "batch": batch, "seq": seq, "micro": micro,
                    "rounds": rounds})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    r0 = rows[0]
    head = (f"Qwen3-MoE-shaped model ({r0['shape'].label}, {r0['shape'].params() / 1e6:.1f}M parameters), "
            f"B={r0['batch']} x T={r0['seq']} (global), microbatches of {r0['micro']}, fp32, one thread per "
            f"rank; medians of {r0['rounds']} interleaved rounds (load average {r0['load']:.1f} at the end).")
    table = common.md_table(
        ["layout", "variant", "step, wall (s)", "step, CPU (s)", "× bare, CPU [IQR]", "× bare, wall",
         "peak memory/rank (MiB)"],
        [[r["layout"], r["variant"], f"{r['median_s']:.3f}", f"{r['cpu_s']:.3f}",
          f"{r['cpu_ratio']:.3f} [{r['cpu_iqr'][0]:.2f}–{r['cpu_iqr'][1]:.2f}]", f"{r['ratio']:.3f}",
          f"{r['mem_mb']:.0f}"] for r in rows], "llrrrrr")
    notes = ("× bare: the median over rounds of moe_rl / bare within one round; IQR: the middle half of "
             "those per-round ratios, i.e. how precise the median is on this machine today. CPU: this "
             "rank's CPU time, which other load moves less than wall time. Peak memory: what the variant "
             "added while built and stepped (weights, gradients, Adam state, the step's working memory), on "
             f"top of the process's {r0['base_mb']:.0f} MiB with torch and megatron imported; the two "
             "variants of a layout compare to within a few MiB, absolute values move by ~20 MiB with what "
             "the process ran before.")
    parts = [head, table, notes]
    for layout in dict.fromkeys(r["layout"] for r in rows):
        bare, ours = (next(r for r in rows if r["layout"] == layout and r["variant"] == v) for v in ("bare", "moe_rl"))
        cells = [[label, f"{bare[k] * 1e3:.1f}", f"{ours[k] * 1e3:.1f}", f"{(ours[k] - bare[k]) * 1e3:+.1f}",
                  f"{(ours[k] - bare[k]) / bare['cpu_s'] * 100:+.1f}%"]
                 for label, k in (("inside megatron's schedule: forward, loss, backward", "schedule_s"),
                                  ("outside: batching, grad reduction, optimizer, LR, metrics", "outside_s"),
                                  ("whole step", "cpu_s"))]
        parts.append(f"Where the time goes, {layout} (CPU ms, medians):\n\n" + common.md_table(
            ["part", "bare", "moe_rl", "moe_rl − bare", "of the bare step"], cells))
    agree = max(r["loss_diff"] for r in rows)
    parts.append(f"Same weights, batch and updates on both sides: their per-step losses agree within {agree:.1e}.")
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2], choices=sorted(LAYOUT_OF_WORLD),
                   help="1: one rank; 2: EP2 on two gloo ranks")
    p.add_argument("--batch", type=int, default=BASE_BATCH)
    p.add_argument("--seq", type=int, default=BASE_SEQ)
    p.add_argument("--micro", type=int, default=BASE_MICRO, help="sequences per microbatch")
    a = p.parse_args(argv)
    print(format_table(bench_rows(a.rounds, tuple(a.worlds), BASE, a.batch, a.seq, a.micro)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
