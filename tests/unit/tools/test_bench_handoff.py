"""tools/bench/handoff_bytes.py on its smallest setting: with the real hand-off code, each rank now
receives its data-parallel share of the step (1/DP of what the broadcast sent it), and the bytes
agree with the formula the bench scales to the flagship."""
from __future__ import annotations


def test_each_rank_receives_its_share_and_the_formula_holds(bench):
    hb = bench["handoff_bytes"]
    n, t, r = 8, 256, 128  # large enough that pickling overhead (per sample, per prompt) stays under 5%
    rows = {row["variant"]: row for row in hb.bench_rows(n, t, r)}
    whole = hb.step_bytes(n, t, r, hb.FLAGSHIP["layers"], hb.FLAGSHIP["topk"])
    dp = len(hb.MP)
    for rank in (1, 2, 3):
        assert abs(rows["broadcast"]["received"][rank] / whole - 1) < 0.05
        assert abs(rows["share_out"]["received"][rank] / (whole / dp) - 1) < 0.05
    table = hb.format_table(list(rows.values()), n, t, r)
    assert "| samples and engine routes received | 1.87 GB | 0.47 GB | 1/4 |" in table
