"""An episode's turns stay on one server (SGLangClient + EpisodeRunner, GenerateRequest.affinity).

Each turn of a multi-turn episode sends the whole context so far; on the server that holds it in its
prefix cache only the new tokens are prefilled. R3 requests bypass the router (it drops
return_routed_experts), so the client balanced them least-loaded and each turn landed on another server.
"""
from __future__ import annotations

from collections import defaultdict

from moe_rl.data.dataset import Prompt
from moe_rl.env.base import Turn
from moe_rl.rollout.engine import GenerateRequest, SamplingParams
from moe_rl.rollout.episodes import TURN_SEED_STRIDE, EpisodeRunner
from moe_rl.rollout.server_pool import Server, affine
from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.testing import make_tiny_qwen3_moe


class _ThreeTurns:
    """Answers each turn with two tokens; the episode ends after its third model turn."""

    stop_token_ids = ()

    def __init__(self):
        self.turn = 0

    def reset(self, prompt):
        return [5]

    def step(self, ids):
        self.turn += 1
        return Turn(observation=[6, 7], reward=0.0, done=self.turn >= 3)


class _Spy:
    """The client, recording which server answered each turn of each episode (by its prompt: ids so far)."""

    def __init__(self, client):
        self.client, self.calls = client, []

    def generate(self, requests):
        out = self.client.generate(requests)
        self.calls += [(r, res[0].server) for r, res in zip(requests, out)]
        return out


def test_every_turn_of_an_episode_goes_to_one_server(tmp_path):
    from moe_rl.rollout.local_engine import LocalEngine
    from moe_rl.rollout.server import ServerThread

    model = make_tiny_qwen3_moe(tmp_path / "tiny")
    servers = [ServerThread(LocalEngine(model), enable_return_routed_experts=True).start() for _ in range(3)]
    try:
        with SGLangClient([s.url for s in servers]) as client:
            spy = _Spy(client)
            runner = EpisodeRunner(_ThreeTurns, max_turns=3, max_episode_tokens=64, eos_id=2)
            prompts = [Prompt(f"p{i}", [1, 3 + i, 4], "", None) for i in range(5)]
            reqs = [GenerateRequest(p.prompt_ids, SamplingParams(max_new_tokens=2, seed=10 * i, n=2, ignore_eos=True))
                    for i, p in enumerate(prompts)]
            episodes = runner.generate(spy, prompts, reqs)
    finally:
        for s in servers:
            s.stop()
    assert all(ep.turns == 3 for group in episodes for ep in group)
    # a turn's seed is its episode's plus turn x TURN_SEED_STRIDE (the episodes' seeds are below the stride)
    per_episode: dict[int, set] = defaultdict(set)
    per_group: dict[tuple, set] = defaultdict(set)
    for req, server in spy.calls:
        per_group[tuple(req.prompt_ids[:3])].add(server)
        per_episode[req.sampling.seed % TURN_SEED_STRIDE].add(server)
    assert len(spy.calls) == 5 * 2 * 3 and len(per_episode) == 10
    assert all(len(s) == 1 for s in per_episode.values()), per_episode  # one server per episode
    assert all(len(s) == 1 for s in per_group.values()), per_group  # and per prompt group
    assert len(set().union(*per_group.values())) >= 2  # the groups are spread over the servers


def test_affinity_keeps_a_key_on_one_server_and_moves_only_a_lost_servers_keys():
    servers = [Server(f"http://10.0.0.{i}:30000") for i in range(3)]
    keys = [f"episode-{i}" for i in range(300)]
    home = {k: affine(k, servers) for k in keys}
    assert all(affine(k, list(reversed(servers))) is home[k] for k in keys)  # the order of the pool does not matter
    share = [sum(home[k] is s for k in keys) / len(keys) for s in servers]
    assert min(share) > 0.2, share  # spread over every server
    lost = servers[1]
    moved = {k: affine(k, [servers[0], servers[2]]) for k in keys}
    assert all(moved[k] is home[k] for k in keys if home[k] is not lost)
    assert all(moved[k] is not lost for k in keys)
