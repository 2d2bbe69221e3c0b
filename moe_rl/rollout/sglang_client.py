"""`RolloutEngine` over SGLang's native HTTP API: one or many servers, or one sglang-router.

Works the same against `python -m sglang.launch_server ... --enable-return-routed-experts`
and against `moe-rl serve` (which speaks the same API on CPU).

Behind sglang-router (`SGLangClient(urls=[router], admin_urls=workers)`): sglang-router
0.3.2 re-serialises /generate into a fixed struct that has no `return_routed_experts`,
so routes never come back through it. A generate request that asks for routed experts
therefore goes straight to the workers (`admin_urls`), balanced by this client
(least-loaded, with the same health checks and retries as without a router; requests that
share a `GenerateRequest.affinity` key, an episode's turns, stay on one worker); every
other generate request goes through the router. Weight updates, pause / flush and
memory release / resume always go to the workers, which the router does not relay them to.

Robustness (health probes, retries with backoff, least-loaded picking): the
`ServerPool` it is built on (moe_rl/rollout/server_pool.py). A server that recovers
first proves it is this run's and gets the latest weights when it missed an update.

Request bodies and endpoints: moe_rl/rollout/sglang_api.py; replies: moe_rl/rollout/wire.py.

Model info: GET /model_info (its name since sglang 0.5.23), falling back to the older
/get_model_info on a 404.

Colocated memory: `release_memory_occupation()` marks the servers released and
`generate()` resumes them first, so a rollout after an eval or a skipped step never
reaches a server that gave its memory away; `resume_memory_occupation()` sends nothing
when they are not released. A release frees SGLang's weights region, and resuming it maps
fresh memory without the weights (SGLang 0.5.23 keeps them only with
--enable-weights-cpu-backup): after a resume the weights count as lost until the next
weight update, and a `generate()` that comes first (after an eval, a skipped step, a critic
warm-up step) loads the last weights again (`_target_weights`, or `initial_weights` before
any update) before it samples.

Seeds: a request with `seed` s and n > 1 is sent as n items with `sampling_seed`
s, s+1, ..., so the samples differ and rerun identically (SGLang applies one
sampling_seed to all n copies, and honours it only when launched with
--enable-deterministic-inference): one batched /generate per prompt group
(`sglang_api.group_payload`), or, behind a router, n requests (sglang-router 0.3.2
re-serialises /generate into its own struct, and we send it only the single form).

Log-probs: SGLang returns log(softmax(logits / T)), the distribution the token was
sampled from, which is this framework's convention (see engine.py).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from moe_rl.rollout.auth import RunKeys
from moe_rl.rollout.engine import (GenerateRequest, GenerateResult, RolloutError, WeightsSource, moe_layer_ids,
                                   num_experts_of, topk_of)
from moe_rl.rollout.server_pool import Retryable, Server, ServerPool, Unreachable
from moe_rl.rollout.sglang_api import (CONTINUE_GENERATION, FLUSH_CACHE, GENERATE, INITIAL_WEIGHT_VERSION,
                                       MODEL_INFO, MODEL_INFO_OLD, PAUSE_GENERATION, RELEASE_MEMORY, RESUME_MEMORY,
                                       SERVER_INFO, UPDATE_FROM_DISK, disk_update_payload, generate_payload,
                                       group_payload)
from moe_rl.rollout.wire import in_place_spans, parse_reply, read_hf_config
from moe_rl.routes import Geometry

log = logging.getLogger(__name__)


class SGLangClient(ServerPool):
    """RolloutEngine over SGLang servers (or `moe-rl serve`).

    urls: server base URLs (`http://host:port`), or one sglang-router URL.
    admin_urls: where weight updates / pause / flush go (default: `urls`); behind a
        router, pass the worker URLs here: generate requests that ask for routed
        experts go to them directly (the router drops that field).
    num_layers / topk / num_experts / moe_layer_ids: the model's geometry for the
        routed-experts checks. Left None, they come from the server's /model_info
        (moe-rl serve reports them) or from `<model_path>/config.json` when readable.
    retry_aborted: resubmit samples that came back with finish_reason "abort"
        (e.g. from pause_generation) instead of returning them.
    keys: the run's api / admin keys (moe_rl/rollout/auth.py), sent as Bearer tokens.
    served_name: the `served_model_name` the servers were launched with (the run id): a
        server whose /server_info reports another name is not ours and is never used.
    initial_weights: the HF checkpoint the servers started from: what a colocated server
        loads again when it resumed from a release before any weight update (see above).
    flush_on_update: ask for SGLang's cache flush with each weight update (its default); off for
        pushes under requests paused in place, where SGLang refuses the flush and fails the call.
    version_lag: how many pushes back a sample's tokens may have been generated: 0 = every token
        from the last pushed weights; 1 for in-place pushes, whose paused samples span the last two.
    pushes_in_place: the pushes pause generation in place (rollout.inflight_update=in_place): on servers
        with SGLang's overlap scheduler (`disable_overlap_schedule` false in /server_info, its default)
        each sample's version spans are read as `wire.in_place_spans` says, one token later than labelled.
    """

    def __init__(self, urls: Sequence[str] | str, *, admin_urls: Sequence[str] | None = None,
                 max_concurrency: int = 64, request_timeout: float = 600.0, connect_timeout: float = 10.0,
                 max_attempts: int = 4, backoff_base: float = 0.5, backoff_max: float = 10.0,
                 probe_interval: float = 5.0, probe_timeout: float = 20.0, no_server_timeout: float = 60.0,
                 num_layers: int | None = None, topk: int | None = None, num_experts: int | None = None,
                 moe_layer_ids: Sequence[int] | None = None, retry_aborted: bool = False,
                 keys: RunKeys | None = None, served_name: str | None = None,
                 initial_weights: str | Path | None = None, flush_on_update: bool = True, version_lag: int = 0,
                 pushes_in_place: bool = False):
        super().__init__(urls, admin_urls=admin_urls, max_concurrency=max_concurrency,
                         request_timeout=request_timeout, connect_timeout=connect_timeout,
                         max_attempts=max_attempts, backoff_base=backoff_base, backoff_max=backoff_max,
                         probe_interval=probe_interval, probe_timeout=probe_timeout,
                         no_server_timeout=no_server_timeout, keys=keys, served_name=served_name)
        self.retry_aborted = retry_aborted
        self._geo_args = (num_layers, topk, num_experts, None if moe_layer_ids is None else list(moe_layer_ids))
        self._geometry: Geometry | None = None
        self._target_weights: tuple[str, str | None] | None = None  # last (path, version) applied
        # the labels of the weights the servers served, oldest first: those they started with, then each push's
        self._labels: list[str] = [INITIAL_WEIGHT_VERSION]
        self.pushes_in_place = bool(pushes_in_place)
        self._overlap: bool | None = None  # the servers run SGLang's overlap scheduler (read once, if needed)
        self._stale_resamples = 0  # samples generated again because their server sampled with other weights
        self.flush_on_update, self.version_lag = bool(flush_on_update), int(version_lag)
        self._released = False  # the servers gave their memory away (release_memory_occupation)
        self._weights_lost = False  # resumed from a release with no weight load since
        self._initial_weights = None if initial_weights is None else str(initial_weights)
        self._resume_lock: asyncio.Lock | None = None  # made on the client's loop, at first use

    async def _on_recovered(self, server: Server) -> None:
        await self._check_identity(server)
        await self._bring_up_to_date(server)

    @property
    def released(self) -> bool:
        """True between `release_memory_occupation()` and the next resume (explicit or by `generate`)."""
        return self._released

    # ---------------------------------------------------------------- identity

    async def _check_identity(self, server: Server) -> None:
        """Refuse (RolloutError) a server whose /server_info names another run than `served_name`:
        whatever answers on a dead server's port may be another run's or another model."""
        if self.served_name is None:
            return
        info = await self._json(server, "GET", SERVER_INFO, timeout=self.probe_timeout)
        name = info.get("served_model_name") if isinstance(info, dict) else None
        if name != self.served_name:
            raise RolloutError(f"server {server.url} is not this run's: it serves {name!r}, expected "
                               f"{self.served_name!r}; it is not used")

    async def _model_info(self, server: Server) -> Any:
        """GET /model_info; /get_model_info (its name before sglang 0.5.23) when that is a 404."""
        for path in (MODEL_INFO, MODEL_INFO_OLD):
            status, body = await self._request(server, "GET", path, timeout=self.probe_timeout)
            if status != 404:
                break
        return self._decode(server, path, status, body)

    # ------------------------------------------------------------------ geometry
    async def _resolve_geometry(self) -> Geometry:
        if self._geometry is not None:
            return self._geometry
        n_layers, topk, n_exp, moe = self._geo_args
        info: dict[str, Any] = {}
        if n_layers is None or (topk is None and moe != []):
            server = await self._pick(self._admin)  # the servers themselves, not a router
            try:
                info = await self._model_info(server)
            except Retryable as e:
                self._mark_unhealthy(server, str(e))
                raise RolloutError(f"server {server.url}: cannot read /model_info: {e}") from None
            cfg: dict[str, Any] = {}
            if "moe_layer_ids" not in info or info.get("num_hidden_layers") is None:
                cfg = read_hf_config(info.get("model_path"))
            n_layers = n_layers or info.get("num_hidden_layers") or cfg.get("num_hidden_layers")
            topk = topk or info.get("num_experts_per_tok") or (topk_of(cfg) if cfg else None)
            n_exp = n_exp or info.get("num_experts") or (num_experts_of(cfg) if cfg else None)
            if moe is None:
                if "moe_layer_ids" in info:
                    moe = info["moe_layer_ids"]
                elif cfg:
                    moe = moe_layer_ids(cfg) or []  # None: a dense model
        if moe == [] and n_layers:  # dense model: no routes to decode
            self._geometry = Geometry(int(n_layers), int(topk or 0), None, [])
            return self._geometry
        if not n_layers or not topk:
            raise RolloutError(
                "cannot tell the model's number of layers / top-k to decode routed_experts: the servers' "
                f"/model_info does not report them and {info.get('model_path')!r} has no readable "
                "config.json here; pass SGLangClient(num_layers=..., topk=..., num_experts=...)")
        moe = list(range(int(n_layers))) if moe is None else [int(x) for x in moe]
        self._geometry = Geometry(int(n_layers), int(topk), None if n_exp is None else int(n_exp), moe)
        return self._geometry

    # ---------------------------------------------------------------- generation
    def generate(self, requests: list[GenerateRequest], timeout: float | None = None) -> list[list[GenerateResult]]:
        """Sync: one list of n results per request, in order. Raises RolloutError."""
        return self._run(self._generate(requests), timeout)

    async def agenerate(self, requests: list[GenerateRequest]) -> list[list[GenerateResult]]:
        """Async variant, awaitable from any event loop."""
        return await self._on_loop(self._generate(requests))

    async def _recheck_identity(self) -> None:
        """Before a batch: each healthy server we update directly must still be the run's own (a
        server that died between two calls may have been replaced by a stranger on its port)."""
        if self.served_name is None:
            return
        await self._check_each([s for s in self._admin if s.healthy], self._check_identity)

    async def _generate(self, requests: list[GenerateRequest]) -> list[list[GenerateResult]]:
        self._ensure_session()
        await self._recheck_identity()
        if self._released:
            log.debug("servers were released (release_memory_occupation): resuming them before generating")
            await self._aresume()
        if self._weights_lost:
            await self._areload_weights()
        geo = await self._resolve_geometry() if any(r.return_routed_experts for r in requests) else None
        jobs: list[tuple[int, GenerateRequest, bool]] = []  # (request index, request, sent as a group)
        for i, r in enumerate(requests):
            if r.sampling.seed is None or r.sampling.n == 1:
                jobs.append((i, r, False))
            elif self._pool_for(r) is self._servers and self._behind_router:
                jobs.extend((i, one, False) for one in r.single_samples())
            else:
                jobs.append((i, r, True))
        tasks = [asyncio.ensure_future(self._run_job(req, geo, group)) for _, req, group in jobs]
        try:
            done = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        out: list[list[GenerateResult]] = [[] for _ in requests]
        for (i, _, _), res in zip(jobs, done):
            out[i].extend(res)
        return out

    def _pool_for(self, req: GenerateRequest) -> list[Server]:
        """Behind a router, requests for routed experts go to the workers (the router drops the field)."""
        return self._admin if self._behind_router and req.return_routed_experts else self._servers

    async def _run_job(self, req: GenerateRequest, geo: Geometry | None, group: bool = False) -> list[GenerateResult]:
        payload = group_payload(req) if group else generate_payload(req)
        pool = self._pool_for(req)
        errors: list[str] = []
        for attempt in range(1, self.max_attempts + 1):
            server = await self._pick(pool, req.affinity)
            assert self._sem is not None
            async with self._sem:
                server.inflight += 1
                try:
                    sent = self._labels[-1]
                    data = await self._json(server, "POST", GENERATE, payload)
                    results = parse_reply(server.url, req, data, geo)
                    if self.pushes_in_place and await self._overlap_schedule(server):
                        results = [replace(r, weight_versions=in_place_spans(r.weight_versions, sent, self._labels))
                                   for r in results]
                    stale = self._stale_version(results)
                    if stale is not None:  # a restarted server that has not taken the weights yet
                        self._stale_resamples += len(results)
                        errors.append(f"{server.url}: sampled with weight version {stale!r}, expected "
                                      f"{self._target_weights[1]!r}")  # type: ignore[index]
                        await self._resync(server)
                        continue
                    if self.retry_aborted and any(r.finish_reason == "abort" for r in results) \
                            and attempt < self.max_attempts:
                        errors.append(f"{server.url}: sample aborted by the server")
                        await asyncio.sleep(self._backoff(attempt))
                        continue
                    return results
                except Retryable as e:
                    self._mark_unhealthy(server, str(e))
                    errors.append(f"{server.url}: {e}")
                finally:
                    server.inflight -= 1
            if attempt < self.max_attempts:
                await asyncio.sleep(self._backoff(attempt))
        raise RolloutError(f"generate failed after {self.max_attempts} attempts: " + " | ".join(errors[-4:]))

    def _stale_version(self, results: list[GenerateResult]) -> str | None:
        """A weight version a sample's tokens report that is not among the last `version_lag` + 1
        the servers served (else None). The weights they started with count as the first of them,
        as SGLang labels them "default": a request alive at the first push reports a
        ("default", 0, k) span, which is version 0, good while 0 is within `version_lag`."""
        if self._target_weights is None or self._target_weights[1] is None:
            return None
        accepted = set(self._labels[-(self.version_lag + 1):])  # the target among them
        # every span of a sample's tokens (SGLang's weight_versions), else the version it reports
        return next((v for r in results
                     for v in ([s[0] for s in r.weight_versions] if r.weight_versions else [r.weight_version])
                     if v is not None and v not in accepted), None)

    def take_stale_resamples(self) -> int:
        """Samples generated again since the last call because their server reported weights outside
        the accepted versions (a restarted server that had not taken the last push)."""
        async def take() -> int:  # on the client's loop, where the count grows: no count is lost
            n, self._stale_resamples = self._stale_resamples, 0
            return n
        return int(self._run(take()))

    async def _overlap_schedule(self, server: Server) -> bool:
        """Whether the servers run SGLang's overlap scheduler (its default, unless launched with
        --disable-overlap-schedule): /server_info of the first that answers, read once."""
        if self._overlap is None:
            info = await self._json(server, "GET", SERVER_INFO, timeout=self.probe_timeout)
            self._overlap = not bool(info.get("disable_overlap_schedule", False)) if isinstance(info, dict) else True
        return self._overlap

    async def _resync(self, server: Server) -> None:
        """After a sample from stale weights: a server we update directly goes out of rotation
        until a probe has loaded the weights; behind a router (which may have sent the request to
        any worker), every worker reporting another version gets the weights now."""
        if not self._behind_router:
            self._mark_unhealthy(server, "serves stale weights")
            return
        await self._check_each(self._admin, self._bring_up_to_date)

    async def _bring_up_to_date(self, server: Server) -> None:
        """Load the last pushed weights into `server` unless its /model_info reports their version."""
        target = self._target_weights
        if target is None:
            return
        path, version = target
        if version is None or str((await self._model_info(server)).get("weight_version")) != version:
            log.info("server %s does not serve weight version %s; applying %s", server.url, version, path)
            await self._update_one(server, path, version)

    # -------------------------------------------------------------- weight updates

    async def _update_one(self, server: Server, path: str, version: str | None) -> None:
        await self._check_identity(server)  # never push this run's weights into a stranger
        payload = disk_update_payload(path, version, flush_cache=self.flush_on_update)
        d = await self._json(server, "POST", UPDATE_FROM_DISK, payload, ok_statuses=(200, 400))
        if not isinstance(d, dict) or not d.get("success"):
            msg = d.get("message") if isinstance(d, dict) else d
            raise RolloutError(f"server {server.url} refused the weights in {path!r}: {msg}")

    async def _aupdate_weights_from_disk(self, path: str, version: str | None) -> None:
        self._ensure_session()
        servers = self._admin
        res = await asyncio.gather(*(self._update_one(s, path, version) for s in servers),
                                   return_exceptions=True)
        ok = [s for s, r in zip(servers, res) if r is None]
        failed = [(s, r) for s, r in zip(servers, res) if r is not None]
        for s, r in failed:
            if isinstance(r, BaseException) and not isinstance(r, (Retryable, RolloutError)):
                raise r
        if not ok and not all(isinstance(r, Unreachable) for _, r in failed):
            raise RolloutError("weight update failed on every server: "
                               + " | ".join(f"{s.url}: {r}" for s, r in failed))
        # Every server unreachable (dead, restarting): the weights are still the target. None of
        # them serves again before a probe has applied them, and the next call waits for one
        # (`_pick`, up to no_server_timeout), so nothing generates from stale weights.
        self._record_push(path, version)
        for s, r in failed:  # stale now: kept out of rotation until a probe re-applies the update
            self._mark_unhealthy(s, f"missed weight update {version}: {r}")
        if not ok:
            log.warning("no server reachable for weights %s; whichever comes back takes them before it serves",
                        path)
        elif failed:
            log.warning("weights %s applied on %d of %d servers; the others are re-tried when probed",
                        path, len(ok), len(servers))

    def _record_push(self, path: str, version: str | None) -> None:
        """The servers' weights are now `path`, labelled `version` (their target, also for a server that
        missed the push); the last `version_lag` + 1 labels stay accepted on samples."""
        self._target_weights = (path, version)
        if version is not None and version != self._labels[-1]:
            self._labels.append(version)
        self._weights_lost = False

    def push_record(self) -> tuple[tuple[str, str | None] | None, list[str]]:
        """The weights the servers serve as this client pushed them (`follow_push` of another client)."""
        return self._target_weights, list(self._labels)

    def follow_push(self, record: tuple[tuple[str, str | None] | None, list[str]]) -> None:
        """Take another client's `push_record`: this client generates only (a data-parallel head's,
        rollout.intake=heads) and accepts and labels its samples' weight versions as that one does."""
        self._target_weights, labels = record
        self._labels = list(labels)
        self._weights_lost = False

    def update_weights_from_disk(self, path: str | Path, version: str | int | None = None) -> None:
        """POST /update_weights_from_disk to every (admin) server.

        Raises RolloutError when every server refused the weights (then nothing changed).
        Servers that refused or were unreachable are kept out of rotation and get the
        update again when their /health answers; when none was reachable, the next call
        waits for one to come back with these weights.
        """
        self._run(self._aupdate_weights_from_disk(str(path), None if version is None else str(version)))

    def update_weights(self, path_or_tensors: WeightsSource, version: str | int | None = None) -> None:
        if isinstance(path_or_tensors, (str, Path)):
            return self.update_weights_from_disk(path_or_tensors, version)
        raise NotImplementedError("SGLangClient loads weights from disk: save the tensors as a HF checkpoint "
                                  "and call update_weights_from_disk(path, version)")

    # --------------------------------------------------------------- admin calls

    def flush_cache(self) -> None:
        self._run(self._broadcast("POST", FLUSH_CACHE, json_reply=False))

    def pause_generation(self, mode: str = "abort") -> None:
        """SGLang PauseGenerationReqInput: mode "abort" | "retract" | "in_place". A server that cannot
        be reached (dead, restarting) is taken out of rotation, not waited for: its requests fail
        and are sent again, a restarted server is not paused, and the weight push that follows
        reaches it when its probe answers."""
        self._run(self._abroadcast_reachable(PAUSE_GENERATION, {"mode": mode}))

    def continue_generation(self) -> None:
        self._run(self._abroadcast_reachable(CONTINUE_GENERATION, {}))

    async def _abroadcast_reachable(self, path: str, payload: Any) -> None:
        """POST `path` to every admin server; those that fail as a server fails (no answer, 5xx) are
        marked unhealthy for the probe to bring back; any other answer than success raises."""
        self._ensure_session()
        servers = self._admin
        res = await asyncio.gather(*(self._json(s, "POST", path, payload) for s in servers), return_exceptions=True)
        for s, r in zip(servers, res):
            if isinstance(r, Retryable):
                self._mark_unhealthy(s, f"{path}: {r}")
                log.warning("server %s did not take %s (%s); it is probed before it serves again", s.url, path, r)
            elif isinstance(r, BaseException):
                raise r

    def release_memory_occupation(self) -> None:
        """Colocated runs: SGLang frees its weights and KV cache (ReleaseMemoryOccupationReqInput)
        so training can use the GPU memory; needs servers started with --enable-memory-saver.
        Marks the servers released: the next `generate` resumes them first."""
        self._run(self._broadcast("POST", RELEASE_MEMORY, {}))
        self._released = True

    def _lock(self) -> asyncio.Lock:
        if self._resume_lock is None:
            self._resume_lock = asyncio.Lock()
        return self._resume_lock

    async def _aresume(self) -> None:
        async with self._lock():  # concurrent generate calls resume once
            if self._released:
                await self._broadcast("POST", RESUME_MEMORY, {})
                self._released, self._weights_lost = False, True  # the region is back, its content is not

    async def _areload_weights(self) -> None:
        """After a resume with no weight update since the release: load the current weights again
        (SGLang's resumed weights region holds no weights), once for concurrent callers."""
        async with self._lock():
            if not self._weights_lost:
                return
            path, version = self._target_weights or (self._initial_weights, None)
            if path is None:
                raise RolloutError("the servers resumed from a memory release, which lost their weights, and no "
                                   "weights are known to load again: pass SGLangClient(initial_weights=...) or "
                                   "update the weights before generating")
            log.info("servers resumed from a memory release with no weight update since: loading %s again", path)
            await self._aupdate_weights_from_disk(path, version)

    def resume_memory_occupation(self) -> None:
        """Colocated runs: SGLang takes its memory back before the next weight update and rollout.
        Sends nothing when the servers are not released."""
        if self._released:
            self._run(self._on_loop_resume())

    async def _on_loop_resume(self) -> None:
        self._ensure_session()
        await self._aresume()

    def server_infos(self) -> dict[str, Any]:
        """GET /server_info of every server we update directly (the workers behind a router), by URL; a
        server that does not answer is left out."""
        async def go() -> dict[str, Any]:
            self._ensure_session()
            servers = self._admin
            res = await asyncio.gather(*(self._json(s, "GET", SERVER_INFO, timeout=self.probe_timeout)
                                         for s in servers), return_exceptions=True)
            return {s.url: r for s, r in zip(servers, res) if not isinstance(r, BaseException)}
        return self._run(go())

    def get_model_info(self) -> dict[str, Any]:
        """GET /model_info of one server (a worker behind a router)."""
        async def go() -> Any:
            self._ensure_session()
            server = await self._pick(self._admin)
            try:
                return await self._model_info(server)
            except Retryable as e:
                self._mark_unhealthy(server, str(e))
                raise RolloutError(f"server {server.url}: {e}") from None
        return self._run(go())
