"""`moe_rl.testing.run_ranks` starts its ranks from a fork server: with megatron-core already imported, with the
caller's environment of the call (not the server's, which started with an earlier one), and with
none of the caller's state."""
from __future__ import annotations

import os
import sys

import moe_rl.dist.ports as ports
from moe_rl.testing import run_ranks


def _what_the_rank_sees(name: str) -> dict:
    import torch.distributed as dist

    return {"megatron_loaded": "megatron.core.optimizer" in sys.modules, "value": os.environ.get(name),
            "rank": int(os.environ["RANK"]), "group_rank": dist.get_rank(), "caller_mark": hasattr(ports, "_caller_mark")}


def test_ranks_start_preloaded_with_the_callers_environment_and_none_of_its_state(monkeypatch):
    run_ranks(_what_the_rank_sees, 1, "MOE_RL_SPAWN_TEST")  # the fork server is running from here on
    monkeypatch.setenv("MOE_RL_SPAWN_TEST", "set after the server started")
    monkeypatch.setattr(ports, "_caller_mark", True, raising=False)
    seen = run_ranks(_what_the_rank_sees, 2, "MOE_RL_SPAWN_TEST")
    assert [s["rank"] for s in seen] == [0, 1] and [s["group_rank"] for s in seen] == [0, 1]
    # imported once by the server (an ImportError in the preload would only make ranks slow, silently)
    assert all(s["megatron_loaded"] for s in seen)
    assert all(s["value"] == "set after the server started" for s in seen)
    assert not any(s["caller_mark"] for s in seen)  # a fresh interpreter's modules, not the caller's
