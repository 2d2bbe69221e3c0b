"""Multi-turn rollouts: each sample is an episode of model turns and environment answers.

`EpisodeRunner.generate(engine, prompts, requests)` plays `sampling.n` episodes per prompt: every
turn is one `engine.generate` call for all live episodes at once (each episode's whole context
as its prompt, one sample, its own seed per turn), the environment answers each turn
(`moe_rl/env/`), and the answer's ids are appended to the context as they are — no text
between turns, so the trainer trains on exactly the ids the engine produced and the
environment appended. An episode ends when the environment says `done`, after
`rollout.max_turns` model turns, or when `rollout.max_episode_tokens` tokens follow the prompt.

The result of an episode is one `GenerateResult` over everything after the prompt, with
`action_mask` True at the model's tokens and False at the environment's (context, not actions:
masked out of the loss), the engine's log-probs at model tokens (0 at the others), `reward`
the sum of the turns' rewards (or the last turn's: `rollout.episode_reward`) and `turns` the
number of model turns. An environment's answer
after the last model turn is dropped: nothing reads it.

Routes, merged turn by turn: each turn asks only for the rows no earlier turn has
(`routed_experts_start_len`, SGLang's: rows [start, len(context + output) - 1)), so every
position keeps the routes of the forward that first processed it: the prompt's and an
environment answer's, the prefill that first read them; a model token's, the decode step that
fed it (its turn's last token, the next turn's prefill). Re-sending the conversation and keeping
the last request's routes instead would give the earlier turns' tokens the last prefill's routes,
which differ as soon as the weights changed between turns or a near-tie flips. Engines that
return every row (`routes_start` 0) are sliced the same way.

Every turn of a prompt group's episodes carries the group's `affinity` key, so a client of several
servers sends them all to one server, whose prefix cache holds the prompt and each episode's context
so far: a turn prefills only what the last one added, not the whole history on another server.
"""
from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

from moe_rl.data.dataset import Prompt
from moe_rl.env.base import Environment, Turn
from moe_rl.rollout.engine import GenerateRequest, GenerateResult
from moe_rl.routes import Geometry

TURN_SEED_STRIDE = 7_919  # a turn's seed: the episode's seed + turn * stride (no two turns share one)


@dataclass
class _Episode:
    prompt_ids: tuple[int, ...]
    env: Environment
    seed: int | None
    affinity: str | None = None  # its prompt group's key: every turn on the server that has its context cached
    ids: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    action: list[bool] = field(default_factory=list)
    versions: list[str | None] = field(default_factory=list)
    routes: list[np.ndarray] | None = field(default_factory=list)  # row chunks; None once a turn gave none
    route_geometry: Geometry | None = None  # the engine's: the episode's rows are checked as its turns' were
    reward: float = 0.0
    turns: int = 0
    finish: str = "stop"
    done: bool = False

    def append(self, ids: Sequence[int], logp: Sequence[float], action: bool, versions: Sequence[str | None]) -> None:
        self.ids += list(ids)
        self.logp += [float(x) for x in logp]
        self.action += [action] * len(ids)
        self.versions += list(versions)


def _answer(env: Environment, ids: list[int]) -> Turn:
    out = env.step(ids)
    if inspect.isawaitable(out):  # an async environment
        out = asyncio.run(out)
    if not isinstance(out, Turn):
        raise TypeError(f"{type(env).__qualname__}.step returned {type(out).__name__}, not a moe_rl.env.Turn")
    return out


class EpisodeRunner:
    """Plays episodes against an environment (see the module docstring)."""

    def __init__(self, make_env: Callable[[], Environment], max_turns: int, max_episode_tokens: int, eos_id: int,
                 episode_reward: str = "sum"):
        if episode_reward not in ("sum", "last"):
            raise ValueError(f"episode_reward must be 'sum' or 'last', got {episode_reward!r}")
        self.make_env, self.max_turns, self.max_tokens, self.eos_id = make_env, max_turns, max_episode_tokens, eos_id
        self.last_only = episode_reward == "last"

    def generate(self, engine: Any, prompts: Sequence[Prompt], requests: Sequence[GenerateRequest]
                 ) -> list[list[GenerateResult]]:
        """`sampling.n` episodes for each request (whose prompt is `prompts[i]`'s ids), as results."""
        episodes: list[list[_Episode]] = []
        for prompt, req in zip(prompts, requests):
            group = []
            for j in range(req.sampling.n):
                env = self.make_env()
                ep = _Episode(req.prompt_ids, env, None if req.sampling.seed is None else req.sampling.seed + j,
                              req.affinity if req.affinity is not None else f"prompt-{hash(req.prompt_ids)}")
                first = list(env.reset(prompt))[:self.max_tokens - 1]  # room for one model token at least
                ep.append(first, [0.0] * len(first), False, [None] * len(first))
                group.append(ep)
            episodes.append(group)
        flat = [ep for group in episodes for ep in group]
        for turn in range(self.max_turns):
            live = [ep for ep in flat if not ep.done]
            if not live:
                break
            base, routes = requests[0].sampling, requests[0].return_routed_experts
            calls = [GenerateRequest(ep.prompt_ids + tuple(ep.ids), replace(
                base, n=1, seed=None if ep.seed is None else ep.seed + turn * TURN_SEED_STRIDE,
                max_new_tokens=min(base.max_new_tokens, self.max_tokens - len(ep.ids)),
                stop_token_ids=tuple(dict.fromkeys((*base.stop_token_ids, *ep.env.stop_token_ids)))),
                return_routed_experts=routes and ep.routes is not None,
                routed_experts_start_len=self._covered(ep) if routes and ep.routes is not None else 0,
                affinity=ep.affinity)
                for ep in live]
            for ep, (res,) in zip(live, engine.generate(calls)):
                self._play(ep, res, turn)
        return [[self._result(ep) for ep in group] for group in episodes]

    @staticmethod
    def _covered(ep: _Episode) -> int:
        """Route rows this episode has (positions 0..n-1)."""
        return sum(chunk.shape[0] for chunk in ep.routes or [])

    def _play(self, ep: _Episode, res: GenerateResult, turn: int) -> None:
        if ep.routes is not None:
            if res.routed_experts is None:
                ep.routes = None  # an engine without routes: the episode has none
            else:  # the rows past what the earlier turns have (an engine may return every row)
                ep.routes.append(res.routed_experts[self._covered(ep) - res.routes_start:])
                ep.route_geometry = res.route_geometry
        out = list(res.output_ids)
        versions = res.token_versions() or [None] * len(out)
        ep.append(out, res.output_logprobs.tolist(), True, versions)
        ep.turns, ep.finish = turn + 1, res.finish_reason
        answer = _answer(ep.env, out)
        ep.reward = float(answer.reward) + (0.0 if self.last_only else ep.reward)  # rollout.episode_reward
        room = self.max_tokens - len(ep.ids)
        if answer.done or res.finish_reason == "abort" or room <= 0 or turn + 1 == self.max_turns:
            ep.done = True
            return
        obs = list(answer.observation)[:room]
        ep.append(obs, [0.0] * len(obs), False, [versions[-1] if versions else None] * len(obs))
        if len(ep.ids) >= self.max_tokens:
            ep.done, ep.finish = True, "length"

    def _result(self, ep: _Episode) -> GenerateResult:
        while ep.action and not ep.action[-1]:  # an answer after the last model turn: never read
            for xs in (ep.ids, ep.logp, ep.action, ep.versions):
                xs.pop()
        # an environment's opening tokens get the version of the first model token (they are not trained)
        known = [v for v in ep.versions if v is not None]
        if known:
            known = [known[0]] * (len(ep.versions) - len(known)) + known
        versions = None
        if known and len(known) == len(ep.versions):  # spans of equal versions over every token
            spans, start = [], 0
            for i in range(1, len(known) + 1):
                if i == len(known) or known[i] != known[start]:
                    spans.append((known[start], start, i))
                    start = i
            versions = tuple(spans)
        routes = np.concatenate(ep.routes) if ep.routes else None
        return GenerateResult(prompt_ids=list(ep.prompt_ids), output_ids=ep.ids,
                              output_logprobs=np.asarray(ep.logp, dtype=np.float32), finish_reason=ep.finish,
                              routed_experts=routes, weight_versions=versions, action_mask=tuple(ep.action),
                              route_geometry=ep.route_geometry if routes is not None else None,
                              reward=ep.reward, turns=ep.turns)
