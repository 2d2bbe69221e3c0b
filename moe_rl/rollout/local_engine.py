"""Rollout engine on HF transformers: CPU by default, exact log-probs and routed experts.

A hand-written sampling loop over the model's own `forward()` with its KV cache
(`DynamicCache`), so every number it returns is visible here:

  prefill   left-padded prompts -> logits of the last position, routes of every prompt token. With the
            prefix cache (prefix_cache.py, SGLang's radix cache) a prompt's cached start is not computed:
            its keys, values and routes are those cached, and only the rest is fed
  decode    one token per active row -> logits, routes of the fed token; finished rows are
            dropped from the batch and the cache (`DynamicCache.batch_select_indices`)
  retract   after `pause_generation("retract")`, the paused rows are prefilled again, prompt and
            output so far, under the weights they continue with; their earlier routes are
            replaced (SGLang's `reset_for_retract` drops them and its re-prefill captures anew),
            their tokens' log-probs and versions stay those they were sampled with

Log-probs and sampling: sampler.py. Routes: route_recorder.py (the model's own top-k, hooked).

Weight-version labels (`overlap_labels`, on in `moe-rl serve` unless --disable-overlap-schedule): SGLang's
default overlap scheduler launches step N before it processes step N - 1's result, and an in-place pause
leaves the result in flight unprocessed; the weight-version event of a push counts only the processed
tokens, so the token sampled last before an in-place pause, from the old weights, is labelled with the
version that follows (scheduler.py event_loop_overlap, pause_generation, record_weight_version_change;
utils/weight_versions.py). Retract pauses process the result first: their labels are exact.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from moe_rl.rollout.engine import (GenerateRequest, GenerateResult, SamplingParams, WeightsSource, num_experts_of,
                                   version_spans)
from moe_rl.rollout.hf_models import (caches_plain_kv, kv_bytes_per_token, load_model, load_tokenizer, prefilled_cache,
                                      row_kv, select_rows)
from moe_rl.rollout.memory import MEMORY_TAGS, MemoryRegions
from moe_rl.rollout.prefix_cache import PrefixCache, PrefixHit
from moe_rl.rollout.route_recorder import make_recorder
from moe_rl.rollout.sampler import ids_logprobs, prompt_logprobs, sample, top_logprobs
from moe_rl.rollout.weight_load import apply_plan, apply_sparse, check_checkpoint, plan_sparse, plan_tensors
from moe_rl.routes import Geometry, compact as compact_routes

PREFIX_CACHE_BYTES = 1 << 30  # the prefix cache's default size: 1 GiB of keys and values
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class _Row:
    """One sample being generated."""

    __slots__ = ("req", "sample", "prompt", "sp", "gen", "out", "lps", "routes", "finish", "want_routes", "versions",
                 "retractions", "hooks", "cached", "cache_epoch", "lp_start", "top_n", "ids_lp", "in_lps", "in_top",
                 "in_ids", "out_top", "out_ids", "matched")

    def __init__(self, req: int, sample: int, one: GenerateRequest, seed: int):
        self.req, self.sample, self.prompt, self.sp = req, sample, list(one.prompt_ids), one.sampling
        self.gen = torch.Generator(device="cpu").manual_seed(seed % (1 << 63))
        self.out: list[int] = []
        self.lps: list[float] = []
        self.routes: list[torch.Tensor] = []
        self.finish: str | None = None
        self.want_routes = one.return_routed_experts
        self.versions: list[str] = []  # weight version of the forward that produced each output token
        self.retractions = 0  # times a retract pause made it prefill again (SGLang's num_retractions)
        self.hooks = one.hooks
        self.cached = 0  # prompt tokens taken from the prefix cache
        self.cache_epoch = -1  # the prefix cache's epoch when this row's KV was computed
        self.lp_start, self.top_n, self.ids_lp = one.logprob_start_len, one.top_logprobs_num, one.token_ids_logprob
        self.in_lps = self.in_top = self.in_ids = None
        self.out_top: list | None = [] if self.top_n else None
        self.out_ids: list | None = [] if self.ids_lp is not None else None
        self.matched: str | None = None

    def aborted(self) -> bool:
        return self.hooks is not None and self.hooks.aborted(self.sample)


class LocalEngine:
    """`RolloutEngine` on a HF transformers model in this process.

    Thread-safe: `generate` calls are serialized; `update_weights*` load and
    validate outside the lock and swap between two decode steps.

    max_cached_tokens: the prefix cache's size in tokens (0: no prefix cache; None: what PREFIX_CACHE_BYTES
    hold; `moe-rl serve` keeps one, as SGLang does unless --disable-radix-cache). overlap_labels: see the
    module doc.
    """

    def __init__(self, model_dir: str | Path, *, seed: int = 0, dtype: str = "float32",
                 device: str = "cpu", max_batch: int = 64, logprob_mode: str = "scaled",
                 weight_version: str = "default", memory_saver: bool = False, weights_cpu_backup: bool = False,
                 max_cached_tokens: int | None = 0, overlap_labels: bool = False):
        if logprob_mode not in ("raw", "scaled"):
            raise ValueError(f"logprob_mode must be 'raw' or 'scaled', got {logprob_mode!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.dtype = _DTYPES[dtype]
        self.device = device
        self.max_batch = int(max_batch)
        self.logprob_mode = logprob_mode
        self.weight_version = str(weight_version)
        self.overlap_labels = bool(overlap_labels)
        self._lock = threading.RLock()          # model swaps vs forward steps
        self._gen_lock = threading.Lock()       # one generate() at a time
        self._running = threading.Event()       # cleared while paused
        self._running.set()
        self._abort_epoch = 0                   # bumped by pause_generation(mode="abort")
        self._retract_epoch = 0                 # bumped by pause_generation(mode="retract")
        self._inplace_epoch = 0                 # bumped by pause_generation(mode="in_place")
        self._pause_mode: str | None = None     # the mode of the pause in effect
        self._seed_gen = torch.Generator(device="cpu").manual_seed(int(seed))
        self._closed = False
        self.memory = MemoryRegions(memory_saver, weights_cpu_backup)  # what /release_memory_occupation gave up
        self.last_forward_time = 0.0            # time.monotonic() after the latest forward step
        model = load_model(model_dir, self.dtype, device)
        self._install(model, Path(model_dir))
        self._tokenizer: Any = None
        self._tokenizer_loaded = False
        # SGLang keeps no radix cache for hybrid (linear-attention) layers without its mamba cache: neither here
        self.prefix_cache = None
        if max_cached_tokens != 0 and caches_plain_kv(self.config):
            if max_cached_tokens is None:  # as many tokens as PREFIX_CACHE_BYTES hold
                per_token = kv_bytes_per_token(self.model, self._cache_kw, device)
                if self._recorder is not None:
                    self._recorder.take()  # the measuring forward's routes
                max_cached_tokens = max(1, PREFIX_CACHE_BYTES // per_token)
            self.prefix_cache = PrefixCache(max_cached_tokens)

    # ----------------------------------------------------------------- model facts
    def _install(self, model: torch.nn.Module, path: Path) -> None:
        recorder = make_recorder(model)
        old = getattr(self, "_recorder", None)
        import inspect

        # transformers >= 5.x names the KV-cache argument `cache`; earlier releases `past_key_values`.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.model, self.config, self._recorder, self.model_path = model, model.config, recorder, str(path)
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
            self._tokenizer = load_tokenizer(self.model_path)
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
        for what, ids in (("stop_token_ids", req.sampling.stop_token_ids), ("token_ids_logprob",
                                                                              req.token_ids_logprob or ())):
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise ValueError(f"{what} out of range [0, {V}): {bad[:5]}")
        if req.sampling.stop and self.tokenizer is None:
            raise ValueError("sampling_params.stop needs the model's tokenizer, and this model directory has no "
                             "tokenizer files: use stop_token_ids")

    def generate(self, requests: list[GenerateRequest]) -> list[list[GenerateResult]]:
        for r in requests:
            self.validate(r)
        rows: list[_Row] = []
        for i, r in enumerate(requests):
            for j, one in enumerate(r.single_samples()):
                seed = one.sampling.seed
                if seed is None:
                    seed = int(torch.randint(0, 1 << 62, (1,), generator=self._seed_gen))
                rows.append(_Row(i, j, one, seed))
        # SGLang caches the prompt of a request with n > 1 first (one prefill, max_new_tokens 0), so that
        # its n samples find it in the prefix cache (tokenizer_manager._handle_batch_request)
        warm = [_Row(-1, 0, GenerateRequest(r.prompt_ids, SamplingParams(max_new_tokens=0, n=1),
                                            return_routed_experts=False), 0)
                for r in requests if r.sampling.n > 1 and self.prefix_cache is not None]
        with self._gen_lock:
            self._running.wait()  # requests that arrive while paused wait for continue_generation()
            self._check_resident("generate", MEMORY_TAGS)
            epoch = self._abort_epoch
            for batch in (warm, rows):
                # Similar prompt lengths together: less padding.
                order = sorted(range(len(batch)), key=lambda k: len(batch[k].prompt))
                for s in range(0, len(order), self.max_batch):
                    self._generate_chunk([batch[k] for k in order[s:s + self.max_batch]], epoch)
        out: list[list[GenerateResult]] = [[] for _ in requests]
        for row in rows:  # rows are in (request, sample) order
            out[row.req].append(self._result(row))
        return out

    def _result(self, row: _Row, routes: bool = True) -> GenerateResult:
        got = None
        # A sample aborted before its prefill ran has no routes (and no output).
        if routes and row.want_routes and self._recorder is not None and row.routes:
            n = len(row.prompt) + len(row.out) - 1
            r = torch.cat(row.routes, 0)[:n]
            if r.shape[0] != n:
                raise RuntimeError(f"internal: recorded {r.shape[0]} route rows, expected {n}")
            got = compact_routes(r.numpy(), self.num_experts)
        return GenerateResult(prompt_ids=list(row.prompt), output_ids=list(row.out),
                              output_logprobs=np.asarray(row.lps, dtype=np.float32),
                              finish_reason=row.finish or "length", routed_experts=got,
                              weight_version=row.versions[-1] if row.versions else self.weight_version,
                              weight_versions=version_spans(row.versions, self.weight_version),
                              num_retractions=row.retractions, cached_tokens=row.cached, matched_stop=row.matched,
                              route_geometry=None if got is None else Geometry(
                                  self.num_hidden_layers, self.topk, self.num_experts, self.moe_layer_ids),
                              input_logprobs=row.in_lps, input_top_logprobs=row.in_top,
                              input_token_ids_logprobs=row.in_ids,
                              output_top_logprobs=None if row.out_top is None else list(row.out_top),
                              output_token_ids_logprobs=None if row.out_ids is None else list(row.out_ids))

    # ------------------------------------------------------------- the sampler
    @torch.no_grad()
    def _generate_chunk(self, rows: list[_Row], epoch: int) -> None:
        for r in rows:
            if self._abort_epoch != epoch or r.aborted():  # aborted before this chunk started
                r.finish = "abort"
        rows = [r for r in rows if r.finish is None]
        if not rows:
            return
        dev = self.device
        logits, cache, mask, pos, (version, kv_epoch, inplace_at) = self._prefill(rows, [r.prompt for r in rows], epoch)
        active = list(range(len(rows)))  # rows[active[b]] is batch row b
        for r in rows:
            if r.sp.max_new_tokens == 0:  # a prefill only: its prompt went into the prefix cache
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
            step = [rows[k] for k in active]
            toks, lps, logp = sample(logits, [r.sp for r in step], [r.gen for r in step], self.logprob_mode)
            feed = []
            for b, r in enumerate(step):
                self._append(r, toks[b], lps[b], logp[b], version)
                if r.finish is None:
                    feed.append(b)
                elif r.finish != "abort":
                    self._cache_row(r, cache, mask, b)  # SGLang inserts a finished request's KV
            # Parked while paused: SGLang's scheduler runs no forward then. With its overlap schedule the
            # result of the step in flight at an in-place pause (even one whose rows all finished) is only
            # processed after continue_generation, so its tokens take the next version (module doc).
            if feed or (self.overlap_labels and self._pause_mode == "in_place"):
                self._wait_while_paused(epoch)
            self._relabel(step, inplace_at)
            for r in step:
                if r.hooks is not None and r.finish is None:
                    r.hooks.progress(r.sample, self._result(r, routes=False))
            for b in list(feed):  # pause_generation(mode="abort"), also while parked, or /abort_request
                if self._abort_epoch != epoch or step[b].aborted():
                    step[b].finish = "abort"
                    feed.remove(b)
            if not feed:
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
            while True:
                with self._lock:
                    # Checked under the lock, where a retract bumps the count: a retract that landed since
                    # the cache was computed (also between the park above and here, with the new weights
                    # already in) means the cache is gone. A forward on it would mix the new weights with
                    # the old KV, which SGLang's retract never does, and a row finishing on that token
                    # would keep the old routes. A pause landing after the park waits (no forward while paused).
                    retracted = self._retract_epoch != kv_epoch
                    paused = not self._running.is_set() and self._abort_epoch == epoch
                    if not retracted and not paused:
                        self._relabel([rows[k] for k in active], inplace_at)  # the last word: launched now
                        # counted at launch: an in-place pause landing while this forward runs leaves its
                        # result in flight, as SGLang's overlap schedule does (pause_generation takes no lock)
                        inplace_at = self._inplace_epoch
                        out = self.model(input_ids=nxt, attention_mask=mask, position_ids=pos, use_cache=True,
                                         **{self._cache_kw: cache})
                        routes = self._recorder.take() if self._recorder else None
                        version = self.weight_version
                        self.last_forward_time = time.monotonic()
                if not paused:
                    break
                self._wait_while_paused(epoch)
            if retracted:  # prefill again, prompt and output so far, under the weights the rows continue with
                again = [rows[k] for k in active]
                for r in again:
                    r.retractions, r.routes = r.retractions + 1, []
                logits, cache, mask, pos, (version, kv_epoch, inplace_at) = self._prefill(
                    again, [r.prompt + r.out for r in again], epoch)
                rows, active = again, list(range(len(again)))
                continue
            if routes is not None:
                for b, k in enumerate(active):
                    rows[k].routes.append(routes[b:b + 1])
            logits = out.logits[:, -1, :]

    def _append(self, r: _Row, tok: int, lp: float, logp: torch.Tensor, version: str) -> None:
        """Take the sampled token; decide whether it ends the sample (SGLang's update_finish_state order:
        stop strings, then stop tokens and EOS unless ignore_eos, then the length cap)."""
        r.out.append(tok)
        r.lps.append(lp)
        r.versions.append(version)
        if r.out_top is not None:
            r.out_top.append(top_logprobs(logp, r.top_n))
        if r.out_ids is not None:
            r.out_ids.append(ids_logprobs(logp, r.ids_lp))
        maxpos = self.max_positions
        if r.sp.stop and self._stop_string(r):
            r.finish = "stop"
        elif not r.sp.ignore_eos and (tok in self.eos_token_ids or tok in r.sp.stop_token_ids):
            r.finish = "stop"
        elif len(r.out) >= r.sp.max_new_tokens or (maxpos is not None and len(r.prompt) + len(r.out) >= maxpos):
            r.finish = "length"

    def _relabel(self, step: list[_Row], inplace_at: int) -> None:
        """With overlap labels: an in-place pause since the forward that sampled the rows' last tokens
        (counted `inplace_at`) left that step's result in flight, so SGLang labels its tokens with the
        version of the moment it is processed, when the next forward is launched or the rows finish."""
        if self.overlap_labels and self._inplace_epoch != inplace_at:
            for r in step:
                r.versions[-1] = self.weight_version

    def _stop_string(self, r: _Row) -> bool:
        """Whether the sample's text now holds one of its stop strings (checked on the decoded tail)."""
        tail = self.tokenizer.decode(r.out[-(max(map(len, r.sp.stop)) + 4):],
                                     skip_special_tokens=r.sp.skip_special_tokens)
        for s in r.sp.stop:
            if s in tail:
                r.matched = s
                return True
        return False

    def _wait_while_paused(self, abort_epoch: int) -> None:
        """Until continue_generation(), or an abort pause ends the generate call of `abort_epoch`."""
        while not self._running.wait(0.05) and self._abort_epoch == abort_epoch:
            pass

    def _cache_row(self, r: _Row, cache: Any, mask: torch.Tensor, b: int) -> None:
        """Insert batch row `b`'s computed tokens (prompt and output but the last) into the prefix cache."""
        if self.prefix_cache is None:
            return
        cols = mask[b].bool()
        tokens = (r.prompt + r.out)[:int(cols.sum())]
        keys, values = row_kv(cache, b, cols)
        routes = torch.cat(r.routes, 0)[:len(tokens)] if r.routes else None
        self.prefix_cache.insert(tokens, keys, values, routes, r.cache_epoch)

    def _match(self, r: _Row, tokens: list[int]) -> PrefixHit:
        """SGLang's prefix match: at most len - 1 tokens, and none past the first prompt log-prob wanted."""
        limit = len(tokens) - 1
        if r.lp_start >= 0 and r.in_lps is None:
            limit = min(limit, r.lp_start)
        return self.prefix_cache.match(tokens, limit) if self.prefix_cache is not None else PrefixHit(0)

    def _prefill(self, rows: list[_Row], tokens: list[list[int]], abort_epoch: int
                 ) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor, tuple[str, int, int]]:
        """One forward over `tokens` (a row's prompt, or after a retract its prompt and output so far) but
        their cached starts: the last position's logits, the cache, attention mask, positions, and the
        weight version, retract and in-place pause counts the cache was computed under; every position's
        routes are appended to its row's (the cached positions' from the cache). The computed tokens go
        into the prefix cache (SGLang's checkpoint after a prefill), under the lock: before any flush a
        pause lets through. A paused engine starts no prefill (SGLang's scheduler runs no forward while
        paused): a push pauses, then loads its buckets one by one, so a prefill between two of them
        would compute the cache, routes and first token on half-new weights under the new version's
        label and retract count, and no retract would redo it. Rows of a generate call that an abort
        pause ended go ahead (they finish as aborted at their next step)."""
        dev = self.device
        pad = int(getattr(self.config, "pad_token_id", None) or 0)
        while True:
            self._wait_while_paused(abort_epoch)
            with self._lock:  # a pause may land between the wait and the lock: look again under it
                if not (self._running.is_set() or self._abort_epoch != abort_epoch):
                    continue
                hits = [self._match(r, t) for r, t in zip(rows, tokens)]
                cache, ids, mask, pos = prefilled_cache(self.config, hits, tokens, pad, dev)
                starts = [r.lp_start if r.lp_start >= 0 and r.in_lps is None else len(t) for r, t in zip(rows, tokens)]
                keep = max([1] + [len(t) - s for t, s in zip(tokens, starts)])
                computed = (self.weight_version, self._retract_epoch, self._inplace_epoch)  # at launch (decode's)
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                                 logits_to_keep=keep, **{self._cache_kw: cache})
                routes = self._recorder.take() if self._recorder else None
                self.last_forward_time = time.monotonic()
                for name in ("cache", "past_key_values"):  # the output field follows the argument's name
                    if getattr(out, name, None) is not None:
                        cache = getattr(out, name)
                        break
                S = ids.shape[1]
                if routes is not None:
                    routes = routes.view(len(rows), S, *routes.shape[1:])
                for i, (r, t, hit) in enumerate(zip(rows, tokens, hits)):
                    if hit.routes is not None:
                        r.routes.append(hit.routes)
                    if routes is not None:
                        r.routes.append(routes[i, S - (len(t) - hit.length):])
                    r.cached += hit.length
                    if self.prefix_cache is not None:
                        r.cache_epoch = self.prefix_cache.epoch
                        self._cache_row(r, cache, mask, i)
                break
        for i, (r, t, s) in enumerate(zip(rows, tokens, starts)):
            if r.lp_start >= 0 and r.in_lps is None:
                r.in_lps, r.in_top, r.in_ids = prompt_logprobs(t, s, out.logits[i, keep - (len(t) - s):keep - 1],
                                                               r.top_n, r.ids_lp)
        return out.logits[:, -1, :], cache, mask, pos, computed

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
        The prefix cache is kept: SGLang's caller asks for the flush (flush_cache).
        """
        self._check_resident("update_weights_from_disk", ("weights",))
        new = load_model(path, self.dtype, self.device)
        check_checkpoint(path, new, self.model)
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
        plan = plan_tensors(self.model, items)
        with self._lock:
            self._check_resident("update_weights_from_tensors", ("weights",))  # under the lock: exact
            apply_plan(plan)
            if version is not None:
                self.weight_version = str(version)

    def update_weights_sparse(self, items: Sequence[tuple[str, torch.Tensor, torch.Tensor | None]],
                              version: str | int | None = None) -> None:
        """Apply a delta push: per tensor (name, values, flat indices), or (name, tensor, None) for a
        whole one. Everything is checked before anything is written, as `update_weights_from_tensors`."""
        whole = plan_tensors(self.model, [(n, v) for n, v, idx in items if idx is None])
        sparse = plan_sparse(self.model, [(n, v, idx) for n, v, idx in items if idx is not None])
        with self._lock:
            self._check_resident("update_weights_sparse", ("weights",))
            apply_plan(whole)
            apply_sparse(sparse)
            if version is not None:
                self.weight_version = str(version)

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
        else:
            self._inplace_epoch += 1

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
        """Empty the prefix cache (SGLang's flush_cache); refused (False) while a generate call holds KV
        (`busy`: running or paused in place), as SGLang flushes only an idle scheduler."""
        if self.busy:
            return False
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
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
        generate call runs (SGLang asserts the server is idle for this request). Releasing the KV cache
        empties the prefix cache, whose tensors live there on a GPU."""
        if not self._gen_lock.acquire(blocking=False):
            raise ValueError("release_memory_occupation needs an idle engine, but a generation is running: "
                             "wait for it (or /pause_generation with mode 'abort') and release again")
        try:
            with self._lock:
                self.memory.release(tags, self.model)
                if "kv_cache" in self.memory.released and self.prefix_cache is not None:
                    self.prefix_cache.reset()
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
