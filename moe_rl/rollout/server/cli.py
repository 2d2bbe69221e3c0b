"""`moe-rl serve`: its flags and its main."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

import torch
from aiohttp import web

from moe_rl.rollout.auth import read_key_file
from moe_rl.rollout.server.app import make_app
from moe_rl.rollout.server.common import (BATCHER, DEFAULT_MAX_REQUEST_TOKENS, DEFAULT_PORT, HEALTH_CHECK_TIMEOUT,
                                          SERVER_ARGS)
from moe_rl.rollout.server.thread import _bound_port

def add_arguments(parser: argparse.ArgumentParser) -> None:
    # SGLang's flag names where the option is SGLang's (--model-path, --random-seed, --max-running-requests,
    # ...), so a CPU launch line and a GPU one share their flags; the older names stay as aliases
    parser.add_argument("--model-path", "--model", dest="model", required=True,
                        help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"port (default {DEFAULT_PORT}, as SGLang; 0 picks a free one)")
    parser.add_argument("--random-seed", "--seed", dest="seed", type=int, default=0,
                        help="seed for requests without sampling_seed")
    parser.add_argument("--max-running-requests", "--max-batch", dest="max_batch", type=int, default=32,
                        help="samples per engine batch")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto",
                        help="torch device; auto (default) = cuda when a GPU is visible (the nccl weight sync "
                             "receives on it), else cpu")
    parser.add_argument("--logprob-mode", default="scaled", choices=["scaled", "raw"],
                        help="scaled: log_softmax(logits / T), the distribution sampled from (SGLang's default, "
                             "what the trainer recomputes); raw: log_softmax(logits) at any T (SGLang with "
                             "SGLANG_RETURN_ORIGINAL_LOGPROB=1), for comparisons")
    parser.add_argument("--weight-version", default="default", help="initial weight_version (SGLang: 'default')")
    parser.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body accepted (413 beyond)")
    parser.add_argument("--max-request-tokens", type=int, default=DEFAULT_MAX_REQUEST_TOKENS,
                        help="most tokens one /generate request may cost, prompt tokens + n x max_new_tokens over "
                             f"its prompts (400 beyond; default {DEFAULT_MAX_REQUEST_TOKENS}), so that one request "
                             "cannot hold the server for long")
    parser.add_argument("--health-check-timeout", type=float, default=HEALTH_CHECK_TIMEOUT,
                        help="seconds /health_generate waits for a forward step before answering 503 (SGLang: 20)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--config", default=None,
                        help="YAML file with 'api-key: KEY' and 'admin-api-key: KEY' lines (as SGLang's --config): "
                             "every endpoint but /health* then needs 'Authorization: Bearer KEY', weight and "
                             "control endpoints the admin key; keep the file mode 600")
    parser.add_argument("--api-key", default=None,
                        help="SGLang's flag: the key every endpoint but /health* needs. A key on the command line "
                             "is visible to other users of this machine (ps, /proc); prefer --config")
    parser.add_argument("--admin-api-key", default=None,
                        help="SGLang's flag: the key weight and control endpoints need (same warning; prefer "
                             "--config). Either flag wins over the --config file's line, as in SGLang")
    parser.add_argument("--trusted-dir", action="append", default=None,
                        help="a directory /update_weights_from_disk may load from (repeatable); default: the "
                             "directory that holds --model-path. Other paths are refused (400, a failed load)")
    parser.add_argument("--enable-memory-saver", action="store_true",
                        help="let /release_memory_occupation release memory (SGLang's flag, for colocated runs); "
                             "without it a release is refused. A released weights region loses its content, as "
                             "SGLang's: load weights after resuming, or pass --enable-weights-cpu-backup")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true",
                        help="keep the weights across a release (SGLang copies them to host memory)")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="return each sample's routed experts when a request asks (SGLang's flag: without it "
                             "SGLang captures none and a request's return_routed_experts gets nothing)")
    parser.add_argument("--disable-radix-cache", action="store_true",
                        help="keep no prefix cache (SGLang's flag). With the cache, a prompt starting with tokens "
                             "computed before reuses their keys, values and routes, computed by the weights of "
                             "that moment, until /flush_cache")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="tokens the prefix cache holds at most, least recently used dropped first (SGLang's "
                             "KV pool size; default: as many as 1 GiB of keys and values hold)")
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help="exact weight-version labels (SGLang's flag). By default, as SGLang's overlap "
                             "scheduler, the token sampled last before an in-place pause is labelled with the "
                             "version that follows")
    parser.add_argument("--served-model-name", default=None,
                        help="name /server_info reports (SGLang's flag; the launcher sets the run id, so a "
                             "trainer recognises its own servers)")


def run(args: argparse.Namespace) -> int:
    from moe_rl.rollout.local_engine import LocalEngine

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        keys = read_key_file(args.config) if args.config else None
    except ValueError as e:
        print(f"moe-rl serve: --config: {e}", file=sys.stderr)
        return 2
    # SGLang's precedence: a flag on the command line, then the --config file, then no key
    api_key = args.api_key or (keys.api_key if keys else None)
    admin_api_key = args.admin_api_key or (keys.admin_api_key if keys else None)
    if args.api_key or args.admin_api_key:
        print("moe-rl serve: warning: a key given on the command line is visible to other users of this "
              "machine (ps, /proc/PID/cmdline); put 'api-key: KEY' / 'admin-api-key: KEY' in a file of mode "
              "600 and pass --config FILE instead", file=sys.stderr, flush=True)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    engine = LocalEngine(args.model, seed=args.seed, dtype=args.dtype, device=device,
                         max_batch=args.max_batch, logprob_mode=args.logprob_mode,
                         weight_version=args.weight_version, memory_saver=args.enable_memory_saver,
                         weights_cpu_backup=args.enable_weights_cpu_backup,
                         max_cached_tokens=0 if args.disable_radix_cache else args.max_total_tokens,
                         overlap_labels=not args.disable_overlap_schedule)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        app = make_app(engine, max_batch=args.max_batch, max_body_mb=args.max_body_mb,
                       health_timeout=args.health_check_timeout, max_request_tokens=args.max_request_tokens,
                       server_args={"host": args.host, "random_seed": args.seed,
                                    "served_model_name": args.served_model_name},
                       api_key=api_key, admin_api_key=admin_api_key,
                       trusted_dirs=args.trusted_dir or [Path(args.model).resolve().parent],
                       enable_return_routed_experts=args.enable_return_routed_experts)
        # handler_cancellation: a client that disconnects cancels its call (and its queued chunks)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = app[SERVER_ARGS]["port"] = _bound_port(site, args.port)
        print(f"serving {args.model} on http://{args.host}:{port}", flush=True)
        try:
            await stop.wait()
        finally:
            # End in-flight samples now (finish_reason "abort"): a long request must not hold
            # SIGTERM for as long as it would take to finish, nor start its next chunk.
            await app[BATCHER].stop()
            engine.pause_generation("abort")
            await runner.cleanup()

    try:
        asyncio.run(serve())
    finally:
        engine.close()
    return 0
