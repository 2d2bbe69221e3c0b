"""`moe-rl` command line: one subcommand per user task.

Each subcommand lives next to the code it drives, in a module that exposes
`add_arguments(parser)` and `run(args) -> int`. Modules are imported only when
their subcommand runs, so `moe-rl --help` stays fast and a CPU machine never
imports GPU-only packages. Exit status: 0 done, 1 a check that ran and failed (parity out of
tolerance), 2 input the command cannot take (one line on stderr naming it).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("moe_rl.train.driver", "run RL training from a config file (YAML + key=value overrides)"),
    "serve": ("moe_rl.rollout.server", "serve a HF model over SGLang's native HTTP API (CPU rollout engine)"),
    "check-parity": ("moe_rl.policy.parity", "compare megatron log-probs under parallel layouts against HF transformers"),
    "drift": ("moe_rl.drift.offline", "routing volatility between two HF checkpoints on a JSONL data file"),
    "export": ("moe_rl.train.export", "write a HF checkpoint from a run's checkpoint of any layout"),
    "report": ("moe_rl.observe.report", "plot a run directory's metrics (reward, volatility heatmap, mismatch)"),
    "launch": ("moe_rl.launch.cli", "render and submit multi-node launch scripts (SLURM)"),
    "config": ("moe_rl.config_reference", "list every config key: type, default, allowed values, doc"),
}


def _available() -> dict[str, tuple[str, str]]:
    """Subcommands whose module exists in this installation."""
    out = {}
    for name, (mod, text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(mod) is not None:
            out[name] = (mod, text)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: `moe-rl --help`, no command, or an unknown one. It names the
    subcommands without importing them (torch and megatron would cost seconds); `moe-rl
    COMMAND --help` builds that command's own parser in `main`."""
    parser = argparse.ArgumentParser(
        prog="moe-rl",
        description="RL post-training for Mixture-of-Experts models on megatron-core, "
                    "with SGLang rollouts, routing replay and expert-drift metrics.",
        epilog="`moe-rl COMMAND --help` explains a command and its options.")
    parser.add_argument("--markdown", action="store_true",
                        help=f"print every command's --help as Markdown (`{CLI_REGENERATE}` writes the docs' CLI reference)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_mod, text) in _available().items():
        sub.add_parser(name, help=text, description=text)
    return parser


def command_parser(name: str) -> tuple[argparse.ArgumentParser, object]:
    """`moe-rl NAME`'s parser and module (only that subcommand's module is imported)."""
    module, text = _available()[name]
    mod = importlib.import_module(module)
    p = argparse.ArgumentParser(prog=f"moe-rl {name}", description=text)
    mod.add_arguments(p)
    return p, mod


CLI_REGENERATE = "moe-rl --markdown > docs/reference/cli.md"
HELP_WIDTH = 100  # the reference's --help text is wrapped at a fixed width, whatever the terminal


def markdown_reference() -> str:
    """Every subcommand's `--help`, as the docs' CLI reference (docs/reference/cli.md): generated, so it
    cannot drift from the parsers."""
    parts = ["# CLI reference", "", f"Generated from the parsers by `{CLI_REGENERATE}`; do not edit by hand.", ""]
    for name, (_mod, text) in SUBCOMMANDS.items():
        parser, _ = command_parser(name)
        parser.formatter_class = lambda prog, cls=parser.formatter_class: cls(prog, width=HELP_WIDTH)
        parts += [f"## moe-rl {name}", "", text[0].upper() + text[1:] + ".", "", "```text",
                  parser.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, ValueError) or type(e).__name__ in text else f"{type(e).__name__}: {text}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Import only the chosen subcommand's module, so one broken optional module
    # cannot take the whole CLI down.
    cmds = _available()
    if argv and argv[0] in cmds:
        p, mod = command_parser(argv[0])
        args = p.parse_args(argv[1:])
        try:
            return int(mod.run(args) or 0)
        except (ValueError, OSError) as e:
            # What a command cannot take (a model it does not support, a file that is not there or not
            # readable, a port in use) is one line and exit status 2, as `moe-rl train`'s preflight.
            if os.environ.get("MOE_RL_TRACEBACK"):
                raise
            print(f"moe-rl {argv[0]}: {_one_line(e)} (MOE_RL_TRACEBACK=1 shows where)", file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown_reference(), end="")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
