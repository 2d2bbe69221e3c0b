"""The rollout-engine contract: what the RL loop asks of any generator.

Two engines implement it: `SGLangClient` (SGLang servers over HTTP, or
`moe-rl serve` on CPU) and `LocalEngine` (HF transformers in-process).

Conventions shared by every engine:
- `output_logprobs[t]` is log p(output_ids[t]) under the distribution it was
  sampled from: log_softmax(logits / T) at the request's temperature (T = 1 for
  greedy requests), before any top-k/top-p truncation (training configs refuse
  truncation). That is the quantity the trainer recomputes.
- `routed_experts[i, l, j]` is the j-th expert chosen by the l-th MoE layer for
  the token at position i of `prompt_ids + output_ids`, for i in
  0 .. len(prompt + output) - 2 (the last token is never fed to the model).
  Dense layers are not included. Ids are global expert ids, stored in the
  smallest integer dtype that holds `num_experts - 1` (moe_rl/routes.py: the type, the rules, the
  wire form).
- `finish_reason` is "stop" (a stop / EOS token was sampled; it is the last
  output token), "length" (max_new_tokens reached) or "abort" (the server
  aborted the request, e.g. `pause_generation(mode="abort")`; the output is
  partial and the caller decides whether to retry it).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, Union, runtime_checkable

import numpy as np

from moe_rl.routes import BadRoutes, Geometry, check as check_routes

FINISH_REASONS = ("stop", "length", "abort")


class RolloutError(RuntimeError):
    """A rollout could not be produced; the message names the server (or engine) and the cause."""


# The keys of SGLang 0.5.23's `sampling_params` (its api/v1 JSON contract, sglang/api/v1/api_types.py, checked by
# http_server.generate_request before anything else): any other key is refused with this message's wording.
SGLANG_SAMPLING_KEYS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
                        "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
                        "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                        "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
                        "sampling_seed", "custom_params", "beam_width", "watermark", "choice")
# What the contract's decoder expects of each key this engine reads (the wording of its type errors).
_SGLANG_TYPES = {"max_new_tokens": (int, "i64"), "temperature": (float, "f64"), "top_p": (float, "f64"),
                 "top_k": (int, "i64"), "n": (int, "i64"), "ignore_eos": (bool, "a boolean"),
                 "sampling_seed": (int, "i64"), "skip_special_tokens": (bool, "a boolean"),
                 "no_stop_trim": (bool, "a boolean")}


class SamplingContractError(ValueError):
    """A `sampling_params` that SGLang's JSON contract refuses (its message is SGLang's)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (names follow SGLang's `SamplingParams`).

    temperature 0 means greedy. top_k -1 means the whole vocabulary. `seed`
    makes a request reproducible: sample j of a request with seed s is drawn
    with seed s + j, so the n samples differ yet rerun identically.
    `ignore_eos` keeps generating through EOS (stop_token_ids too), as in SGLang.
    `stop`: strings that end the sample once its text contains one (SGLang's stop; needs a tokenizer),
    trimmed from the reply's text unless `no_stop_trim`.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        stop = self.stop
        object.__setattr__(self, "stop", (stop,) if isinstance(stop, str) else tuple(stop or ()))
        self.validate()

    def validate(self) -> None:
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (whole vocabulary) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {list(self.stop)}")

    @property
    def greedy(self) -> bool:
        # SGLang: temperature < 1e-6 becomes top_k = 1 (sampling_params.py normalize()).
        return self.temperature < 1e-6 or self.top_k == 1

    def to_sglang(self) -> dict[str, Any]:
        """The `sampling_params` dict of SGLang's /generate (sglang/srt/sampling/sampling_params.py)."""
        out: dict[str, Any] = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens, "n": self.n, "ignore_eos": self.ignore_eos,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        if self.stop:
            out["stop"] = list(self.stop)
        return out

    @classmethod
    def from_sglang(cls, d: Mapping[str, Any] | None) -> "SamplingParams":
        """Parse SGLang's `sampling_params` dict. A key outside SGLang's contract, or a value of the wrong
        JSON type, raises SamplingContractError with SGLang's words; a known key that would change
        sampling in a way this engine does not implement raises ValueError."""
        d = dict(d or {})
        for key in d:
            if key not in SGLANG_SAMPLING_KEYS:
                raise SamplingContractError(f"unknown field `{key}`, expected one of "
                                            + ", ".join(f"`{k}`" for k in SGLANG_SAMPLING_KEYS))
        for key, (typ, what) in _SGLANG_TYPES.items():
            v = d.get(key)
            if v is None:
                continue
            ok = isinstance(v, bool) if typ is bool else not isinstance(v, bool) and (
                isinstance(v, int) or (typ is float and isinstance(v, float)))
            if not ok:  # the decoder's (serde's) words for what it got
                got = (f"boolean `{str(v).lower()}`" if isinstance(v, bool) else f"integer `{v}`" if isinstance(v, int)
                       else f"floating point `{v!r}`" if isinstance(v, float) else f'string "{v}"' if isinstance(v, str)
                       else "sequence" if isinstance(v, list) else "map")
                raise SamplingContractError(f"invalid type: {got}, expected {what}")
        unsupported = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                       "repetition_penalty": 1.0, "min_new_tokens": 0, "logit_bias": None,
                       "json_schema": None, "regex": None, "ebnf": None, "stop_regex": None,
                       "structural_tag": None, "beam_width": None, "custom_params": None, "watermark": None,
                       "choice": None}
        for key, neutral in unsupported.items():
            if key in d and d[key] not in (neutral, None, [], {}):
                raise ValueError(f"sampling_params.{key} is not supported by this engine (moe-rl serve): "
                                 "leave it out")
        top_k = d.get("top_k")
        top_k = -1 if top_k is None or int(top_k) >= (1 << 30) else int(top_k)
        seed = d.get("sampling_seed")
        mnt = d.get("max_new_tokens")
        stop = d.get("stop") or []
        if not isinstance(stop, (str, list)) or (isinstance(stop, list) and not all(isinstance(x, str) for x in stop)):
            raise ValueError(f"sampling_params.stop must be a string or a list of strings, got {stop!r}")
        return cls(
            temperature=float(1.0 if d.get("temperature") is None else d["temperature"]),
            top_p=float(1.0 if d.get("top_p") is None else d["top_p"]),
            top_k=top_k,
            max_new_tokens=int(128 if mnt is None else mnt),
            stop_token_ids=tuple(int(t) for t in (d.get("stop_token_ids") or ())),
            seed=None if seed is None else int(seed),
            n=int(1 if d.get("n") is None else d["n"]),
            ignore_eos=bool(d.get("ignore_eos") or False),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            no_stop_trim=bool(d.get("no_stop_trim") or False),
            skip_special_tokens=bool(True if d.get("skip_special_tokens") is None else d["skip_special_tokens"]),
        )


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt (token ids) to sample `sampling.n` completions for."""

    prompt_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_routed_experts: bool = True
    # SGLang's routed_experts_start_len: the routes of positions [start, len(prompt + output) - 1) only,
    # the rows not known yet (a multi-turn episode's earlier turns have the others). In [0, len(prompt)].
    routed_experts_start_len: int = 0
    # Requests of one key go to one server while it is healthy (SGLangClient): an episode's turns and a
    # prompt group's samples find their shared prefix in that server's cache. None: any server.
    affinity: str | None = None
    # SGLang's logprob_start_len: -1 = no prompt log-probs; p in [0, len(prompt)] = those of prompt tokens
    # [p, len) (the first of them None: nothing predicts it), as SGLang's input_token_logprobs
    logprob_start_len: int = -1
    top_logprobs_num: int = 0                         # SGLang's: the n most likely tokens at each position
    token_ids_logprob: tuple[int, ...] | None = None  # SGLang's: the log-probs of these tokens at each position
    # moe-rl serve's hooks into a sample while it runs (`SampleHooks`); None for everyone else
    hooks: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        ids = [int(t) for t in self.prompt_ids]
        if not ids:
            raise ValueError("prompt_ids must not be empty")
        if not 0 <= self.routed_experts_start_len <= len(ids):
            raise ValueError(f"routed_experts_start_len must be in [0, {len(ids)}] (the prompt's tokens), "
                             f"got {self.routed_experts_start_len}")
        if not -1 <= self.logprob_start_len <= len(ids):
            raise ValueError(f"logprob_start_len must be -1 (output tokens only) or in [0, {len(ids)}] (the "
                             f"prompt's tokens), got {self.logprob_start_len}")
        if self.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {self.top_logprobs_num}")
        object.__setattr__(self, "prompt_ids", tuple(ids))
        if self.token_ids_logprob is not None:
            object.__setattr__(self, "token_ids_logprob", tuple(int(t) for t in self.token_ids_logprob))

    def single_samples(self) -> list["GenerateRequest"]:
        """The n samples as n requests with n=1 (seeds s, s+1, ... when seeded)."""
        sp = self.sampling
        return [replace(self, sampling=replace(sp, n=1, seed=None if sp.seed is None else sp.seed + j))
                for j in range(sp.n)]


class SampleHooks(Protocol):
    """What moe-rl serve asks of a running sample (`GenerateRequest.hooks`): `aborted(j)` is asked at every
    step (SGLang's /abort_request of sample j's rid), `progress(j, result)` gets sample j's output so far
    after every step (SGLang's streaming; no routes until it finishes, as SGLang captures them at the end)."""

    def aborted(self, sample: int) -> bool: ...

    def progress(self, sample: int, result: "GenerateResult") -> None: ...


def version_spans(token_versions: Sequence[str], current: str) -> tuple[tuple[str, int, int], ...]:
    """Per-token weight versions as SGLang's spans (compute_weight_version_spans): for no tokens
    one empty span [0, 0) of the `current` version, as SGLang reports."""
    if not token_versions:
        return ((str(current), 0, 0),)
    spans: list[list[Any]] = []
    for i, v in enumerate(token_versions):
        if spans and spans[-1][0] == v:
            spans[-1][2] = i + 1
        else:
            spans.append([v, i, i + 1])
    return tuple((str(v), a, b) for v, a, b in spans)


def check_version_spans(spans: Sequence[tuple[str, int, int]], num_tokens: int) -> None:
    """Spans must cover the output tokens [0, num_tokens) in order, each non-empty (but a single
    [0, 0) for no tokens); ValueError otherwise."""
    if num_tokens == 0 and len(spans) == 1 and tuple(spans[0][1:]) == (0, 0):
        return
    at = 0
    for version, start, end in spans:
        if not isinstance(version, str) or start != at or end <= start:
            raise ValueError(f"weight_versions {list(spans)[:4]} do not cover the {num_tokens} output tokens in "
                             "order ({version, start, end} spans, each starting where the last ended)")
        at = end
    if at != num_tokens:
        raise ValueError(f"weight_versions end at token {at}, the sample has {num_tokens} output tokens")


@dataclass
class GenerateResult:
    """One completion. Shapes: output_logprobs [T_out] float32;
    routed_experts [len(prompt + output) - 1, num_moe_layers, topk] or None."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: np.ndarray
    finish_reason: str
    routed_experts: np.ndarray | None = None
    weight_version: str | None = None
    server: str | None = None  # the URL that produced it (SGLangClient), or None
    # SGLang's meta_info["weight_versions"]: (version, start, end) over the output tokens, in order;
    # more than one when the weights changed while the sample was generated (an in-place pause)
    weight_versions: tuple[tuple[str, int, int], ...] | None = None
    # SGLang's meta_info["num_retractions"]: how often the sample's KV was dropped and prefilled again
    # (a retract pause, or memory pressure); its routes are then the latest prefill's
    num_retractions: int = 0
    # A multi-turn episode (moe_rl/rollout/episodes.py): True at the model's tokens of output_ids, False
    # at the environment's; the episode's reward (rollout.episode_reward: its turns' sum or the last one's)
    # and its number of model turns
    action_mask: tuple[bool, ...] | None = None
    reward: float | None = None
    turns: int = 1
    # the position of routed_experts' first row (a request's routed_experts_start_len; 0: all of them)
    routes_start: int = 0
    # the model's route shape as the engine knows it: routed_experts must have its MoE layers and top-k
    # and ids below its expert count, and messages name its layers (None: only negative ids are refused;
    # the replay's own check refuses the rest against the policy's)
    route_geometry: Geometry | None = None
    # SGLang's meta_info["cached_tokens"]: prompt tokens whose KV (and routes) came from the prefix cache
    cached_tokens: int = 0
    # the stop string that ended the sample (finish_reason "stop" on text); None: a token or not stopped
    matched_stop: str | None = None
    # SGLang's logprob extras (moe-rl serve): prompt log-probs from logprob_start_len (the first None),
    # and per position the top_logprobs_num best / the token_ids_logprob tokens as ([logprob], [token id])
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[tuple[list[float], list[int]] | None] | None = None
    input_token_ids_logprobs: list[tuple[list[float], list[int]] | None] | None = None
    output_top_logprobs: list[tuple[list[float], list[int]]] | None = None
    output_token_ids_logprobs: list[tuple[list[float], list[int]]] | None = None

    def token_versions(self) -> list[str] | None:
        """The weight version of each output token (None when the engine did not say)."""
        if self.weight_versions is None:
            return None if self.weight_version is None else [self.weight_version] * len(self.output_ids)
        return [v for v, start, end in self.weight_versions for _ in range(start, end)]

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        self.output_logprobs = np.asarray(self.output_logprobs, dtype=np.float32)
        if self.weight_versions is not None:
            check_version_spans(self.weight_versions, len(self.output_ids))
        if self.action_mask is not None and len(self.action_mask) != len(self.output_ids):
            raise ValueError(f"action_mask has {len(self.action_mask)} entries, expected {len(self.output_ids)}")
        if self.output_logprobs.shape != (len(self.output_ids),):
            raise ValueError(f"output_logprobs has shape {self.output_logprobs.shape}, "
                             f"expected ({len(self.output_ids)},)")
        if self.routed_experts is not None:
            want = len(self.prompt_ids) + len(self.output_ids) - 1 - self.routes_start
            if self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != want:
                raise ValueError(f"routed_experts has shape {tuple(self.routed_experts.shape)}, expected "
                                 f"[{want}, num_moe_layers, topk] (len(prompt + output) - 1 - start rows)")
            try:  # every engine's rows, once: where they arrive in this process (moe_rl/routes.py `check`)
                g, rows = self.route_geometry, np.asarray(self.routed_experts)
                if g is None:
                    check_routes(rows)
                else:
                    check_routes(rows, g.num_experts, layers=len(g.moe_layers), topk=g.topk, layer_names=g.moe_layers)
            except BadRoutes as e:
                raise BadRoutes(f"{self.server or 'rollout engine'}: routed_experts: {e}") from None

    @property
    def token_ids(self) -> list[int]:
        return list(self.prompt_ids) + list(self.output_ids)


WeightsSource = Union[str, Path, Mapping[str, Any], Sequence[tuple[str, Any]]]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop needs from a rollout engine."""

    def generate(self, requests: list[GenerateRequest]) -> list[list[GenerateResult]]:
        """One list of `request.sampling.n` results per request, in request order."""
        ...

    def update_weights(self, path_or_tensors: WeightsSource, version: str | int | None = None) -> None:
        """Load new policy weights (a HF checkpoint dir, or HF-named tensors); atomic."""
        ...

    def health(self) -> bool:
        """True when the engine can serve `generate` now."""
        ...

    def close(self) -> None:
        """Release its connections, threads and model (the run is over)."""
        ...


def moe_layer_ids(config: Any) -> list[int] | None:
    """Indices of the decoder layers that hold a routed-expert MoE block, from a HF config.

    Covers the common HF conventions (Qwen2/3-MoE `mlp_only_layers` +
    `decoder_sparse_step`, DeepSeek `first_k_dense_replace` + `moe_layer_freq`,
    Mixtral / OLMoE / GPT-OSS: every layer). None when the config has no experts.
    """
    get = (lambda k, d=None: config.get(k, d)) if isinstance(config, Mapping) else \
        (lambda k, d=None: getattr(config, k, d))
    num_experts = get("num_experts") or get("n_routed_experts") or get("num_local_experts")
    if not num_experts:
        return None
    n_layers = int(get("num_hidden_layers"))
    dense = set(get("mlp_only_layers") or [])
    step = int(get("decoder_sparse_step") or 1)
    first_dense = int(get("first_k_dense_replace") or 0)
    freq = int(get("moe_layer_freq") or 1)
    return [i for i in range(n_layers)
            if i not in dense and (i + 1) % step == 0 and i >= first_dense and (i - first_dense) % freq == 0]


def num_experts_of(config: Any) -> int | None:
    get = (lambda k: config.get(k)) if isinstance(config, Mapping) else (lambda k: getattr(config, k, None))
    n = get("num_experts") or get("n_routed_experts") or get("num_local_experts")
    return int(n) if n else None


def topk_of(config: Any) -> int | None:
    get = (lambda k: config.get(k)) if isinstance(config, Mapping) else (lambda k: getattr(config, k, None))
    k = get("num_experts_per_tok") or get("moe_topk") or get("top_k")
    return int(k) if k else None
