"""A step's intake without servers or a model, for tests and tools/bench/handoff_bytes.py: an engine whose
answers are a function of each request's prompt and seed (optionally as SGLang's /generate reply bytes,
parsed by the product's `moe_rl.rollout.wire.parse_reply`), a reward of the ids, and the `run` the batch
code reads (rank 0's intake, `moe_rl.recipes.rl.batch`, or the heads', `moe_rl.recipes.rl.heads`)."""
from __future__ import annotations

import base64
import json
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from moe_rl.data.dataset import Prompt
from moe_rl.data.sampler import PromptSampler
from moe_rl.rollout.engine import GenerateResult
from moe_rl.routes import Geometry
from moe_rl.rollout.wire import parse_reply

VOCAB, EOS = 1000, 2


class SeededEngine:
    """Sample j of a request: a length in `answer` and ids drawn from (its seed, j, its prompt); engine
    log-probs and, with `geometry`, routes too (`[prompt + answer - 1, MoE layers, top-k]`, distinct ids).
    `wire`: each sample goes through SGLang's reply format (JSON, routes base64 of int32 over every
    decoder layer) and `parse_reply`, as the SGLang client does; `bytes_in` counts those bytes and
    `make_s` the CPU seconds spent making them (the server's part, not the receiver's). `fail`: raised by
    `generate` when set."""

    def __init__(self, geometry: Geometry | None = None, answer: tuple[int, int] = (1, 6), wire: bool = False) -> None:
        self.geometry, self.answer, self.wire = geometry, answer, wire
        self.bytes_in, self.make_s, self.fail = 0, 0.0, None

    def generate(self, requests: list[Any]) -> list[list[GenerateResult]]:
        if self.fail is not None:
            raise self.fail
        return [[self._one(r, j) for j in range(r.sampling.n)] for r in requests]

    def _one(self, req: Any, j: int) -> GenerateResult:
        start = time.process_time()
        g = np.random.default_rng([req.sampling.seed or 0, j, sum(req.prompt_ids)])
        n = int(g.integers(self.answer[0], self.answer[1] + 1))
        out = g.integers(3, VOCAB, n).tolist()
        logp = (-g.random(n)).tolist()
        body = {"text": "", "output_ids": out,
                "meta_info": {"id": "0", "finish_reason": {"type": "length", "length": n},
                              "prompt_tokens": len(req.prompt_ids), "completion_tokens": n, "cached_tokens": 0,
                              "weight_version": "default",
                              "output_token_logprobs": [[x, t, None] for x, t in zip(logp, out)]}}
        geo = self.geometry
        if geo is not None and req.return_routed_experts:
            rows, k, e = len(req.prompt_ids) + n - 1, geo.topk, geo.num_experts
            ids = np.zeros((rows, geo.num_layers, k), dtype="<i4")
            ids[:, geo.moe_layers] = (g.integers(0, e, (rows, len(geo.moe_layers), 1)) + np.arange(k) * (e // k)) % e
            body["meta_info"]["routed_experts"] = base64.b64encode(ids.tobytes()).decode("ascii")
        if self.wire:
            raw = json.dumps(body).encode()
            self.bytes_in += len(raw)
            self.make_s += time.process_time() - start
            body = json.loads(raw)
        return parse_reply("seeded", replace(req, sampling=replace(req.sampling, n=1)), body, geo)[0]


def id_reward(prompts: Any, completions: Any, ids: list[list[int]]) -> list[float]:
    """1.0 where the sample's ids sum to an even number: groups of 2 agree about half the time (DAPO drops them)."""
    return [float(sum(x) % 2 == 0) for x in ids]


class _Prompts(list):
    tokenizer = None  # completions as ids (`rollouts._text`)


def intake_run(cfg: Any, rank: int, dp_rank: int, dp_size: int, peers: list[int], engine: Any,
               moe_layers: list[int], prompts: int = 64, prompt_len: int = 6) -> SimpleNamespace:
    """The `run` the step's intake reads, with `prompts` prompts of `prompt_len` ids; `engine` None on
    ranks that do not ask the servers. Its `intake` and `rollouts` are the caller's to set."""
    dataset = _Prompts(Prompt(uid=f"p{i}", prompt_ids=[1] + [3 + (i * 7 + j) % 50 for j in range(prompt_len - 1)],
                              prompt_text="", answer=None) for i in range(prompts))
    policy = SimpleNamespace(dp_size=dp_size, dp_rank=dp_rank, model_parallel_ranks=list(peers),
                             packs_sequences=True, arch=SimpleNamespace(moe_layers=list(moe_layers)))
    return SimpleNamespace(cfg=cfg, rank=rank, policy=policy, dataset=dataset, engine=engine, episodes=None,
                           sampler=PromptSampler(len(dataset), cfg.data.prompts_per_step, seed=cfg.data.shuffle_seed),
                           rewards=SimpleNamespace(score=id_reward, failures=0), weight_version=0, eos_id=EOS)
