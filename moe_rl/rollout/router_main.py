"""sglang-router with its api key read from a file, never from a command line.

    python -m moe_rl.rollout.router_main --api-key-file auth.yaml --host H --port P --worker-urls ...

sglang-router 0.3.2 takes the key only as `--api-key KEY` (router_args.py; no environment
variable, no file). A command line is world-readable: `ps` on the node shows the srun client's
argv and the router's own until it renames itself. So this reads the run's key file (mode 600,
the `api-key:` line of SGLang's `--config` format, moe_rl/rollout/auth.py) and hands the key
to the router's Python entry point (`parse_router_args` + `launch_router`, what
`python -m sglang_router.launch_router` runs); every other argument goes to the router as given.
"""
from __future__ import annotations

import argparse
import sys

from moe_rl.rollout.auth import read_key_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_rl.rollout.router_main", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api-key-file", required=True,
                        help="file with an 'api-key: KEY' line (the servers' --config file, mode 600)")
    ours, router_argv = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if any(a == "--api-key" or a.startswith("--api-key=") for a in router_argv):
        parser.error("--api-key puts the key on a command line; give it in --api-key-file only")
    try:
        key = read_key_file(ours.api_key_file).api_key
    except ValueError as e:
        parser.error(f"--api-key-file: {e}")
    from sglang_router.launch_router import launch_router, parse_router_args

    args = parse_router_args(router_argv)
    args.api_key = key
    launch_router(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
