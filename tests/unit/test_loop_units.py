"""Pure helpers of the RL loop."""
from __future__ import annotations

import pytest

from moe_rl.loop import usable_groups


@pytest.mark.parametrize("kept,g,unit,expected", [
    (5, 16, 4, 5),   # every group fits
    (3, 6, 4, 2),    # 18 samples do not split into 4 shares, 12 do
    (3, 3, 4, 0),    # no number of 3-sample groups up to 3 splits into 4
    (4, 3, 4, 4),    # 12 samples
    (0, 8, 2, 0),    # everything was filtered
])
def test_usable_groups_keeps_the_most_whole_groups_that_split_evenly(kept, g, unit, expected):
    assert usable_groups(kept, g, unit) == expected
