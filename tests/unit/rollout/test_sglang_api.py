"""SGLang's HTTP API is spoken from one module (moe_rl/rollout/sglang_api.py): no other product module
spells an endpoint, and every endpoint the client side calls is one `moe-rl serve` answers, so the
CPU rehearsal exercises each call a cluster run makes."""
from __future__ import annotations

import ast
from pathlib import Path

from moe_rl.rollout import sglang_api
from moe_rl.rollout.server import ROUTES

PACKAGE = Path(sglang_api.__file__).resolve().parents[1]
ENDPOINTS = {name: value for name, value in vars(sglang_api).items()
             if name.isupper() and isinstance(value, str) and value.startswith("/")}
# Modules that may spell a path themselves: the API module, and launch/task.py, which imports only the
# standard library by design (it runs on a SLURM node before the environment is imported) and waits on /health.
SPELLS_ITS_OWN = {"rollout/sglang_api.py", "launch/task.py"}
# The caller side: the rollout client and its pool, the weight syncs, the launcher.
CALLERS = ["rollout/sglang_client.py", "rollout/server_pool.py", "rollout/launcher.py", "rollout/weight_sync"]
# Called but not served, and why: sglang-router's readiness (the router's, not a server's).
NOT_SERVED = {"READINESS"}


def _modules(*places: str) -> list[Path]:
    out = []
    for place in places:
        p = PACKAGE / place
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def test_no_product_module_spells_an_sglang_endpoint():
    paths = set(ENDPOINTS.values())
    spelled = []
    for f in _modules("."):
        rel = f.relative_to(PACKAGE).as_posix()
        if rel in SPELLS_ITS_OWN:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and node.value in paths:
                spelled.append(f"{rel}:{node.lineno} {node.value}")
    assert not spelled, f"endpoint literals outside sglang_api.py: {spelled}"


def test_every_endpoint_the_client_side_calls_is_served_by_moe_rl_serve():
    called = set()
    for f in _modules(*CALLERS):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "moe_rl.rollout.sglang_api":
                called |= {a.name for a in node.names if a.name in ENDPOINTS}
    assert {"GENERATE", "UPDATE_FROM_DISK", "INIT_GROUP", "UPDATE_FROM_DISTRIBUTED", "HEALTH"} <= called
    served = {path for _, paths, _ in ROUTES for path in paths}
    missing = sorted(f"{name} {ENDPOINTS[name]}" for name in called - NOT_SERVED if ENDPOINTS[name] not in served)
    assert not missing, f"called by the client side but not answered by moe-rl serve: {missing}"
