"""`make bench`: run every benchmark in tools/bench/ and write bench/RESULTS.md.

Each benchmark measures its variants side by side in one run and reports ratios,
so the table stays meaningful on a shared, noisy machine.
"""
from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import losses  # noqa: E402
import replay  # noqa: E402
import rollout  # noqa: E402


def main() -> int:
    sections = []
    start = time.monotonic()
    sections.append(("Losses: forward + backward vs a plain token-level PG loss",
                     losses.format_table(losses.bench_rows(repeats=5, warmup=2))))
    sections.append(("Rollout engine: LocalEngine vs transformers generate()", rollout.format_table(rollout.bench_rows())))
    sections.append(("Routing replay and drift measurement overhead", replay.format_table(replay.bench_rows(rounds=3))))
    header = (f"# Benchmarks\n\nMachine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
              f"torch {torch.__version__}; total {time.monotonic() - start:.0f} s.\n")
    text = header + "".join(f"\n## {title}\n\n{table}\n" for title, table in sections)
    out = Path("bench") / "RESULTS.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
