"""Rollout engine on HF transformers: CPU by default, exact log-probs and routed experts.

A hand-written sampling loop over the model's own `forward()` with its KV cache
(`DynamicCache`), so every number it returns is visible here:

  prefill   left-padded prompts [B, P] -> logits of the last position, routes of every prompt token
  decode    one token per active row -> logits, routes of the fed token; finished rows are
            dropped from the batch and the cache (`DynamicCache.batch_select_indices`)
  retract   after `pause_generation("retract")`, the paused rows are prefilled again, prompt and
            output so far, under the weights they continue with; their earlier routes are
            replaced (SGLang's `reset_for_retract` drops them and its re-prefill captures anew),
            their tokens' log-probs and versions stay those they were sampled with

Log-probs: `output_logprobs[t] = log_softmax(logits / T)[token]`, the distribution
the token was sampled from (before top-k / top-p truncation), as SGLang's sampler
returns by default (sglang/srt/layers/sampler.py) and as the trainer recomputes it.
Greedy rows count as T = 1. `logprob_mode="raw"` gives log_softmax(logits) at any T
(SGLang with `SGLANG_RETURN_ORIGINAL_LOGPROB=1`), for comparisons only.

Routes: a forward hook on every router module (`Qwen3MoeTopKRouter`, which
returns (router_logits, scores, indices)) records the indices the model itself
used, so the top-k rule is the model's own. Routers that return only logits get
softmax + top-k (`num_experts_per_tok`), the Qwen/Mixtral rule.
"""
from __future__ import annotations

import inspect
import math
import re
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from moe_rl.drift.routes import RouteCaptureError, router_modules, router_topk
from moe_rl.rollout.engine import (GenerateRequest, GenerateResult, RolloutError, SamplingParams,
                                   WeightsSource, num_experts_of, to_route_dtype, version_spans)
from moe_rl.rollout.fused_weights import partner, split_pairs
from moe_rl.rollout.hf_models import load_model, select_rows
from moe_rl.rollout.memory import MEMORY_TAGS, MemoryRegions

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Mixtral's checkpoint names (pushes send them, as SGLang's mixtral loader reads them) as transformers' modules
_MIXTRAL_PARTS = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w2.": ".down_proj.", ".w3.": ".up_proj."}
_MIXTRAL_RE = re.compile(r"\.block_sparse_moe\.|\.w[123]\.")


class _RouteRecorder:
    """Forward hooks on the router modules; `take()` returns this forward's top-k ids.

    `take()` gives an int64 tensor [num_tokens, num_moe_layers, topk] in layer order.
    """

    def __init__(self, model: torch.nn.Module, topk: int):
        self.topk = topk
        try:
            routers = router_modules(model)  # (layer, module) in layer order
        except RouteCaptureError as e:
            raise RolloutError(str(e)) from None
        self.layer_ids: list[int] = [layer for layer, _ in routers]
        self._slots: list[torch.Tensor | None] = [None] * len(routers)
        self._handles = [mod.register_forward_hook(self._hook(pos)) for pos, (_, mod) in enumerate(routers)]

    def _hook(self, pos: int):
        def hook(_mod, _inp, out):
            idx = router_topk(out, self.topk)
            self._slots[pos] = idx.reshape(-1, idx.shape[-1]).detach().to("cpu", torch.int64)
        return hook

    def take(self) -> torch.Tensor | None:
        if not self._slots:
            return None
        if any(s is None for s in self._slots):
            missing = [self.layer_ids[i] for i, s in enumerate(self._slots) if s is None]
            raise RolloutError(f"no routes recorded for MoE layers {missing}")
        out = torch.stack(self._slots, dim=1)  # [tokens, layers, k]
        self._slots = [None] * len(self._slots)
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class _Row:
    """One sample being generated."""

    __slots__ = ("req", "sample", "prompt", "sp", "gen", "out", "lps", "routes", "finish", "want_routes",
                 "versions", "retractions")

    def __init__(self, req: int, sample: int, prompt: list[int], sp: SamplingParams, seed: int,
                 want_routes: bool):
        self.req, self.sample, self.prompt, self.sp = req, sample, prompt, sp
        self.gen = torch.Generator(device="cpu").manual_seed(seed % (1 << 63))
        self.out: list[int] = []
        self.lps: list[float] = []
        self.routes: list[torch.Tensor] = []
        self.finish: str | None = None
        self.want_routes = want_routes
        self.versions: list[str] = []  # weight version of the forward that produced each output token
        self.retractions = 0  # times a retract pause made it prefill again (SGLang's num_retractions)


class LocalEngine:
    """`RolloutEngine` on a HF transformers model in this process.

    Thread-safe: `generate` calls are serialized; `update_weights*` load and
    validate outside the lock and swap between two decode steps.
    """

    def __init__(self, model_dir: str | Path, *, seed: int = 0, dtype: str = "float32",
                 device: str = "cpu", max_batch: int = 64, logprob_mode: str = "scaled",
                 weight_version: str = "default", memory_saver: bool = False, weights_cpu_backup: bool = False):
        if logprob_mode not in ("raw", "scaled"):
            raise ValueError(f"logprob_mode must be 'raw' or 'scaled', got {logprob_mode!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.dtype = _DTYPES[dtype]
        self.device = device
        self.max_batch = int(max_batch)
        self.logprob_mode = logprob_mode
        self.weight_version = str(weight_version)
        self._lock = threading.RLock()          # model swaps vs forward steps
        self._gen_lock = threading.Lock()       # one generate() at a time
        self._running = threading.Event()       # cleared while paused
        self._running.set()
        self._abort_epoch = 0                   # bumped by pause_generation(mode="abort")
        self._retract_epoch = 0                 # bumped by pause_generation(mode="retract")
        self._pause_mode: str | None = None     # the mode of the pause in effect
        self._seed_gen = torch.Generator(device="cpu").manual_seed(int(seed))
        self._closed = False
        self.memory = MemoryRegions(memory_saver, weights_cpu_backup)  # what /release_memory_occupation gave up
        self.last_forward_time = 0.0            # time.monotonic() after the latest forward step
        model = load_model(model_dir, self.dtype, device)
        self._install(model, Path(model_dir))
        self._tokenizer: Any = None
        self._tokenizer_loaded = False

    # ----------------------------------------------------------------- model facts
    def _install(self, model: torch.nn.Module, path: Path) -> None:
        cfg = model.config
        topk = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        recorder = _RouteRecorder(model, topk) if topk else None
        if recorder is not None and not recorder.layer_ids:
            recorder.remove()
            recorder = None
        old = getattr(self, "_recorder", None)
        # transformers >= 5.x names the KV-cache argument `cache`; earlier releases `past_key_values`.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.model, self.config, self._recorder, self.model_path = model, cfg, recorder, str(path)
        if old is not None:
            old.remove()

    @property
    def num_hidden_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def moe_layer_ids(self) -> list[int]:
        """Decoder-layer indices that have routed experts (empty for a dense model)."""
        return list(self._recorder.layer_ids) if self._recorder else []

    @property
    def topk(self) -> int:
        return self._recorder.topk if self._recorder else 0

    @property
    def num_experts(self) -> int | None:
        n = num_experts_of(self.config)
        return n if n and self._recorder else None

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.config, getattr(self.model, "generation_config", None)):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if e is None:
                continue
            ids.update(int(x) for x in (e if isinstance(e, (list, tuple)) else [e]))
        return ids

    @property
    def max_positions(self) -> int | None:
        n = getattr(self.config, "max_position_embeddings", None)
        return int(n) if n else None

    @property
    def tokenizer(self) -> Any:
        """The model dir's tokenizer, or None when it has no tokenizer files."""
        if not self._tokenizer_loaded:
            self._tokenizer_loaded = True
            # transformers 5 builds an empty tokenizer for a dir without tokenizer files: look first.
            files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
            if not any((Path(self.model_path) / f).is_file() for f in files):
                return None
            try:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
            except Exception:
                self._tokenizer = None
        return self._tokenizer

    # ------------------------------------------------------------------ protocol
    def health(self) -> bool:
        return not self._closed and self.model is not None

    def validate(self, req: GenerateRequest) -> None:
        """Raise ValueError for a request this engine cannot serve."""
        V = self.vocab_size
        bad = [t for t in req.prompt_ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {V}): {bad[:5]}")
        if self.max_positions and len(req.prompt_ids) >= self.max_positions:
            raise ValueError(f"prompt has {len(req.prompt_ids)} tokens; the model holds at most "
                             f"{self.max_positions} positions")
        bad = [t for t in req.sampling.stop_token_ids if t >= V]
        if bad:
            raise ValueError(f"stop_token_ids out of range [0, {V}): {bad[:5]}")

    def generate(self, requests: list[GenerateRequest]) -> list[list[GenerateResult]]:
        for r in requests:
            self.validate(r)
        rows: list[_Row] = []
        for i, r in enumerate(requests):
            for j, one in enumerate(r.single_samples()):
                seed = one.sampling.seed
                if seed is None:
                    seed = int(torch.randint(0, 1 << 62, (1,), generator=self._seed_gen))
                rows.append(_Row(i, j, list(one.prompt_ids), one.sampling, seed, r.return_routed_experts))
        with self._gen_lock:
            self._running.wait()  # requests that arrive while paused wait for continue_generation()
            self._check_resident("generate", MEMORY_TAGS)
            epoch = self._abort_epoch
            # Similar prompt lengths together: less padding.
            order = sorted(range(len(rows)), key=lambda k: len(rows[k].prompt))
            for s in range(0, len(order), self.max_batch):
                self._generate_chunk([rows[k] for k in order[s:s + self.max_batch]], epoch)
        out: list[list[GenerateResult]] = [[] for _ in requests]
        for row in rows:  # rows are in (request, sample) order
            out[row.req].append(self._result(row))
        return out

    def _result(self, row: _Row) -> GenerateResult:
        routes = None
        # A sample aborted before its prefill ran has no routes (and no output).
        if row.want_routes and self._recorder is not None and row.routes:
            n = len(row.prompt) + len(row.out) - 1
            r = torch.cat(row.routes, 0)[:n]
            if r.shape[0] != n:
                raise RolloutError(f"internal: recorded {r.shape[0]} route rows, expected {n}")
            routes = to_route_dtype(r.numpy(), self.num_experts)
        return GenerateResult(prompt_ids=list(row.prompt), output_ids=list(row.out),
                              output_logprobs=np.asarray(row.lps, dtype=np.float32),
                              finish_reason=row.finish or "length", routed_experts=routes,
                              weight_version=row.versions[-1] if row.versions else self.weight_version,
                              weight_versions=version_spans(row.versions, self.weight_version),
                              num_retractions=row.retractions)

    # ------------------------------------------------------------- the sampler
    @torch.no_grad()
    def _generate_chunk(self, rows: list[_Row], epoch: int) -> None:
        if self._abort_epoch != epoch:  # aborted before this chunk started
            for r in rows:
                r.finish = "abort"
            return
        dev = self.device
        logits, cache, mask, pos, (version, kv_epoch) = self._prefill(rows, [r.prompt for r in rows], epoch)
        active = list(range(len(rows)))  # rows[active[b]] is batch row b
        eos = self.eos_token_ids
        maxpos = self.max_positions
        for r in rows:
            if r.sp.max_new_tokens == 0:
                r.finish = "length"
        while True:
            live = [b for b, k in enumerate(active) if rows[k].finish is None]
            if len(live) < len(active):  # drop finished rows from batch and cache
                if not live:
                    break
                sel = torch.tensor(live, device=dev)
                select_rows(cache, sel)
                logits, mask, pos = logits[sel], mask[sel], pos[sel]
                active = [active[b] for b in live]
            toks, lps = self._sample(logits, [rows[k] for k in active])
            feed = []
            for b, k in enumerate(active):
                r = rows[k]
                t = toks[b]
                r.out.append(t)
                r.lps.append(lps[b])
                r.versions.append(version)
                if not r.sp.ignore_eos and (t in eos or t in r.sp.stop_token_ids):
                    r.finish = "stop"  # SGLang checks stop tokens before the length cap
                elif len(r.out) >= r.sp.max_new_tokens or \
                        (maxpos is not None and len(r.prompt) + len(r.out) >= maxpos):
                    r.finish = "length"
                else:
                    feed.append(b)
            if not feed:
                break
            self._wait_while_paused(epoch)  # parked by pause_generation(mode="in_place" / "retract")
            if self._abort_epoch != epoch:  # pause_generation(mode="abort"), also while parked
                for k in active:
                    if rows[k].finish is None:
                        rows[k].finish = "abort"
                break
            if len(feed) < len(active):
                sel = torch.tensor(feed, device=dev)
                select_rows(cache, sel)
                mask, pos = mask[sel], pos[sel]
                toks = [toks[b] for b in feed]
                active = [active[b] for b in feed]
            nxt = torch.tensor(toks, dtype=torch.long, device=dev).view(-1, 1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
            with self._lock:
                # Checked under the lock, where a retract bumps the count: a retract that landed since
                # the cache was computed (also between the park above and here, with the new weights
                # already in) means the cache is gone. A forward on it would mix the new weights with
                # the old KV, which SGLang's retract never does, and a row finishing on that token
                # would keep the old routes.
                retracted = self._retract_epoch != kv_epoch
                if not retracted:
                    out = self.model(input_ids=nxt, attention_mask=mask, position_ids=pos, use_cache=True,
                                     **{self._cache_kw: cache})
                    routes = self._recorder.take() if self._recorder else None
                    version = self.weight_version
                    self.last_forward_time = time.monotonic()
            if retracted:  # prefill again, prompt and output so far, under the weights the rows continue with
                again = [rows[k] for k in active]
                for r in again:
                    r.retractions, r.routes = r.retractions + 1, []
                logits, cache, mask, pos, (version, kv_epoch) = self._prefill(again, [r.prompt + r.out for r in again],
                                                                              epoch)
                continue
            if routes is not None:
                for b, k in enumerate(active):
                    rows[k].routes.append(routes[b:b + 1])
            logits = out.logits[:, -1, :]

    def _wait_while_paused(self, abort_epoch: int) -> None:
        """Until continue_generation(), or an abort pause ends the generate call of `abort_epoch`."""
        while not self._running.wait(0.05) and self._abort_epoch == abort_epoch:
            pass

    def _prefill(self, rows: list[_Row], tokens: list[list[int]], abort_epoch: int
                 ) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor, tuple[str, int]]:
        """One forward over left-padded `tokens` (a row's prompt, or after a retract its prompt and
        output so far): the last position's logits, the cache, attention mask, positions, and the
        weight version and retract count the cache was computed under; every position's routes
        are appended to its row's. A paused engine starts no prefill (SGLang's scheduler runs no
        forward while paused): a push pauses, then loads its buckets one by one, so a prefill
        between two of them would compute the cache, routes and first token on half-new weights
        under the new version's label and retract count, and no retract would redo it. Rows of a
        generate call that an abort pause ended go ahead (they finish as aborted at their next
        step)."""
        from transformers.cache_utils import DynamicCache

        dev = self.device
        B, P = len(rows), max(len(t) for t in tokens)
        pad = int(getattr(self.config, "pad_token_id", None) or 0)
        ids = torch.full((B, P), pad, dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for i, t in enumerate(tokens):
            ids[i, P - len(t):] = torch.tensor(t)
            mask[i, P - len(t):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)
        while True:
            self._wait_while_paused(abort_epoch)
            with self._lock:  # a pause may land between the wait and the lock: look again under it
                if self._running.is_set() or self._abort_epoch != abort_epoch:
                    epoch = self._retract_epoch  # under the lock: the retract count this cache is computed under
                    cache = DynamicCache(config=self.config)
                    out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                                     logits_to_keep=1, **{self._cache_kw: cache})
                    routes = self._recorder.take() if self._recorder else None
                    computed = (self.weight_version, epoch)
                    self.last_forward_time = time.monotonic()
                    break
        if routes is not None:
            routes = routes.view(B, P, *routes.shape[1:])
            for i, (r, t) in enumerate(zip(rows, tokens)):
                r.routes.append(routes[i, P - len(t):])
        for name in ("cache", "past_key_values"):  # the output field follows the argument's name
            if getattr(out, name, None) is not None:
                cache = getattr(out, name)
                break
        return out.logits[:, -1, :], cache, mask, pos, computed

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> tuple[list[int], list[float]]:
        """Sample one token per row; return tokens and their log-probs (see module doc)."""
        logits = logits.float().cpu()
        B, V = logits.shape
        # greedy rows count as temperature 1, as SGLang's normalize() turns temperature 0 into top_k=1, T=1
        temps = torch.tensor([1.0 if r.sp.greedy else r.sp.temperature for r in rows]).view(B, 1)
        scaled = logits / temps
        if self.logprob_mode == "raw":
            logp = torch.log_softmax(logits, dim=-1)
        else:
            logp = torch.log_softmax(scaled, dim=-1)
        greedy = torch.tensor([r.sp.greedy for r in rows])
        u = torch.stack([torch.rand((), generator=r.gen) for r in rows]).view(B, 1)
        # Inverse-CDF sampling over the tokens sorted by probability, for every row alike, so a
        # row's token depends only on its logits and its own generator (not on its batch company).
        # top-k keeps ranks < k; top-p keeps the smallest prefix whose mass reaches top_p (a token
        # is dropped when the mass before it already exceeds top_p).
        srt, index = scaled.sort(dim=-1, descending=True, stable=True)
        ks = torch.tensor([V if r.sp.top_k == -1 else min(r.sp.top_k, V) for r in rows]).view(B, 1)
        srt = srt.masked_fill(torch.arange(V).view(1, V) >= ks, -math.inf)
        probs = torch.softmax(srt, dim=-1)
        tps = torch.tensor([r.sp.top_p for r in rows]).view(B, 1)
        probs = probs.masked_fill((probs.cumsum(-1) - probs) > tps, 0.0)
        cdf = probs.cumsum(-1)
        choice = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp(max=V - 1).view(B)
        tok = index.gather(1, choice.view(B, 1)).view(B)
        tok = torch.where(greedy, logits.argmax(-1), tok)
        lp = logp.gather(1, tok.view(B, 1)).view(B)
        return tok.tolist(), lp.tolist()

    # ----------------------------------------------------------- weight updates
    def update_weights(self, path_or_tensors: WeightsSource, version: str | int | None = None) -> None:
        """A HF checkpoint dir (str / Path) or HF-named tensors; see the two methods below."""
        if isinstance(path_or_tensors, (str, Path)):
            self.update_weights_from_disk(path_or_tensors, version)
        else:
            self.update_weights_from_tensors(path_or_tensors, version)

    def update_weights_from_disk(self, path: str | Path, version: str | int | None = None) -> None:
        """Load a HF checkpoint dir into a fresh model, validate it, then swap it in.

        A missing, corrupt or mismatched checkpoint raises ValueError and the old
        weights keep serving. `version` None keeps the current weight_version (as SGLang does).
        """
        self._check_resident("update_weights_from_disk", ("weights",))
        new = load_model(path, self.dtype, self.device)
        old_sd = self.model.state_dict()
        new_sd = new.state_dict()
        if type(new) is not type(self.model):
            raise ValueError(f"{str(path)!r} holds a {type(new).__name__}, the engine serves "
                             f"{type(self.model).__name__}")
        if set(old_sd) != set(new_sd):
            diff = sorted(set(old_sd) ^ set(new_sd))
            raise ValueError(f"{str(path)!r} has different parameter names: {diff[:5]}")
        for k, v in new_sd.items():
            if v.shape != old_sd[k].shape:
                raise ValueError(f"{str(path)!r}: {k} has shape {tuple(v.shape)}, "
                                 f"the served model has {tuple(old_sd[k].shape)}")
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise ValueError(f"{str(path)!r}: {k} holds NaN or inf")
        with self._lock:
            self._check_resident("update_weights_from_disk", ("weights",))  # released while loading?
            self._install(new, Path(path))
            if version is not None:
                self.weight_version = str(version)

    def update_weights_from_tensors(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                                    version: str | int | None = None) -> None:
        """Copy HF-named tensors into the served model (in-process weight sync).

        Names are the model's own (`named_parameters()` / buffers), or the
        checkpoint's per-expert names (`...experts.<e>.gate_proj.weight`, `up_proj`,
        `down_proj`), which are written into the fused `gate_up_proj` / `down_proj`
        tensors transformers keeps at runtime. A subset is fine. Every name and
        shape is checked before anything is copied: a bad batch changes nothing.
        """
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        state = dict(self.model.named_parameters())
        state.update(dict(self.model.named_buffers()))
        plan: list[tuple[torch.Tensor, tuple, torch.Tensor, str]] = []
        errors = [f"{n} without {partner(n)}: SGLang fuses the two in one load and drops a lone one"
                  for n in split_pairs((n for n, _ in items), state)]
        for name, value in items:
            value = torch.as_tensor(value)
            target, index = self._resolve(name, state)
            if target is None:
                errors.append(f"unknown parameter {name!r}")
                continue
            want = target[index].shape if index else target.shape
            if tuple(value.shape) != tuple(want):
                errors.append(f"{name}: shape {tuple(value.shape)}, expected {tuple(want)}")
                continue
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                errors.append(f"{name}: holds NaN or inf")
                continue
            plan.append((target, index, value, name))
        if errors:
            raise ValueError("weight update refused, nothing was changed: " + "; ".join(errors[:5])
                             + (f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""))
        with self._lock, torch.no_grad():
            self._check_resident("update_weights_from_tensors", ("weights",))  # under the lock: exact
            for target, index, value, _ in plan:
                dst = target[index] if index else target
                dst.copy_(value.to(device=dst.device, dtype=dst.dtype))
            if version is not None:
                self.weight_version = str(version)

    @staticmethod
    def _resolve(name: str, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, tuple]:
        name = _MIXTRAL_RE.sub(lambda m: _MIXTRAL_PARTS[m.group(0)], name)  # other families' names pass
        if name in state:
            return state[name], ()
        m = _EXPERT_RE.match(name)
        if m is None:
            return None, ()
        prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
        if kind == "down_proj" and f"{prefix}.down_proj" in state:
            t = state[f"{prefix}.down_proj"]
            return (t, (e,)) if e < t.shape[0] else (None, ())
        fused = state.get(f"{prefix}.gate_up_proj")
        if fused is None or e >= fused.shape[0]:
            return None, ()
        half = fused.shape[1] // 2  # rows [0, I) are gate_proj, [I, 2I) up_proj
        rows = slice(0, half) if kind == "gate_proj" else slice(half, 2 * half)
        return fused, (e, rows)

    # ------------------------------------------------------------ pause / resume
    def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating. "abort": in-flight samples end now with finish_reason "abort";
        "in_place" / "retract": in-flight samples wait at their next step; after a retract they
        continue from a fresh prefill of prompt and output so far (their cache is dropped). New
        `generate` calls wait until `continue_generation()`."""
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"mode must be 'abort', 'in_place' or 'retract', got {mode!r}")
        self._running.clear()
        self._pause_mode = mode
        if mode == "abort":
            self._abort_epoch += 1
        elif mode == "retract":
            with self._lock:  # after the forward in flight: the cache it computes is one the retract drops
                self._retract_epoch += 1

    def continue_generation(self) -> None:
        self._pause_mode = None
        self._running.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    @property
    def busy(self) -> bool:
        """A generate call holds KV in the engine: running, or parked by an in-place pause. A retract
        pause frees it (SGLang's retract_all), so a cache flush may follow it."""
        return self._gen_lock.locked() and self._pause_mode != "retract"

    def flush_cache(self) -> bool:
        """No prefix cache is kept between calls: nothing to flush."""
        return True

    def set_weight_version(self, version: str | int) -> None:
        """Relabel the served weights (SGLang's /update_weight_version); the weights stay as they are."""
        with self._lock:
            self.weight_version = str(version)

    # -------------------------------------------------- memory release / resume (memory.py)
    @property
    def memory_released(self) -> list[str]:
        """The memory tags currently released, in SGLang's order ([] when resident)."""
        return self.memory.released

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Release `tags` (None or []: all of MEMORY_TAGS), as `MemoryRegions.release` says; refused while a
        generate call runs (SGLang asserts the server is idle for this request)."""
        if not self._gen_lock.acquire(blocking=False):
            raise ValueError("release_memory_occupation needs an idle engine, but a generation is running: "
                             "wait for it (or /pause_generation with mode 'abort') and release again")
        try:
            with self._lock:
                self.memory.release(tags, self.model)
        finally:
            self._gen_lock.release()

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Take back `tags` (None or []: all of MEMORY_TAGS); what is not released is refused."""
        with self._lock:
            self.memory.resume(tags)

    def _check_resident(self, op: str, needs: Sequence[str]) -> None:
        self.memory.check_resident(op, needs)

    def close(self) -> None:
        self._closed = True
        self._running.set()
        if self._recorder is not None:
            self._recorder.remove()

