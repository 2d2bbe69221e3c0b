"""Rank-aware logging: one readable console on multi-process runs.

A run with N ranks would print every message N times if each process logged
freely. The rules set up by `setup_logging`:

- rank 0 logs at the chosen level to the console (a rich handler when stdout is
  a terminal, plain timestamped lines otherwise) and to `log_file`;
- other ranks print only warnings and errors, to stderr, prefixed `[rank N]`,
  so a problem on any rank is never hidden;
- with `all_ranks=True` (debugging hangs) every rank logs at the chosen level,
  prefixed `[rank N]`, and ranks other than 0 write `<log_file stem>.rank<N><suffix>`
  so that processes never interleave writes into one file.

Only the `moe_rl` logger tree is configured; other libraries' loggers are left
as their owners set them. Use `get_logger(__name__)` in every module.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler

__all__ = ["ROOT_LOGGER", "get_console", "get_logger", "parse_level", "setup_logging"]

ROOT_LOGGER = "moe_rl"
"""Name of the logger every moe_rl module logs under."""

_PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
_MARK = "_moe_rl_handler"  # set on handlers we install, so a second setup replaces only ours
_CONSOLE: Console | None = None


def get_console() -> Console:
    """The rich console shared by the rank-0 log handler and the live progress view.

    One console for both lets rich print log lines above the live view instead
    of tearing it. It writes to whatever `sys.stdout` is at write time.
    """
    global _CONSOLE
    if _CONSOLE is None:
        _CONSOLE = Console()
    return _CONSOLE


def get_logger(name: str) -> logging.Logger:
    """A logger under the `moe_rl` tree (`get_logger(__name__)`, or a short name like "trainer")."""
    if name == ROOT_LOGGER or name.startswith(ROOT_LOGGER + "."):
        return logging.getLogger(name)
    return logging.getLogger(f"{ROOT_LOGGER}.{name}")


def parse_level(level: str | int) -> int:
    """A logging level from a name ("debug", "INFO", ...) or a number."""
    if isinstance(level, int):
        return level
    value = logging.getLevelName(level.strip().upper())
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    return value


def setup_logging(level: str | int = "info", rank: int = 0, all_ranks: bool = False,
                  log_file: str | Path | None = None) -> logging.Logger:
    """Configure the `moe_rl` logger for this process; returns it.

    Safe to call again (e.g. once the rank is known): handlers installed by an
    earlier call are replaced, handlers added by others are kept.
    """
    lvl = parse_level(level)
    logger = logging.getLogger(ROOT_LOGGER)
    _remove_our_handlers(logger)
    handlers = [_console_handler(lvl, rank, all_ranks)]
    path = _log_path(log_file, rank, all_ranks)
    if path is not None:
        handlers.append(_file_handler(path, lvl, rank))
    for handler in handlers:
        setattr(handler, _MARK, True)
        logger.addHandler(handler)
    # The logger must pass everything any handler wants; handlers filter further.
    logger.setLevel(min(h.level for h in handlers))
    # Our handlers print the records; passing them on to a root handler that
    # some library configured would print every line twice.
    logger.propagate = False
    return logger


def _remove_our_handlers(logger: logging.Logger) -> None:
    for handler in list(logger.handlers):
        if getattr(handler, _MARK, False):
            logger.removeHandler(handler)
            handler.close()


def _console_handler(level: int, rank: int, all_ranks: bool) -> logging.Handler:
    prefix = f"[rank {rank}] " if (all_ranks or rank != 0) else ""
    if rank == 0:
        handler = _rank0_console_handler(prefix)
        handler.setLevel(level)
        return handler
    # Plain lines: one write per record keeps lines whole when ranks interleave.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(prefix + _PLAIN_FORMAT, _DATE_FORMAT))
    # Without all_ranks, other ranks still show their warnings and errors.
    handler.setLevel(level if all_ranks else max(level, logging.WARNING))
    return handler


def _rank0_console_handler(prefix: str) -> logging.Handler:
    console = get_console()
    if console.is_terminal:
        handler: logging.Handler = RichHandler(console=console, show_path=False, markup=False,
                                               rich_tracebacks=True, log_time_format="[%X]")
        handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
        return handler
    # Not a terminal (CI, SLURM output file): rich would wrap lines at 80
    # columns, so write plain lines that grep and tail read well.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(prefix + _PLAIN_FORMAT, _DATE_FORMAT))
    return handler


def _log_path(log_file: str | Path | None, rank: int, all_ranks: bool) -> Path | None:
    """Rank 0 writes `log_file`; other ranks write their own file only with all_ranks."""
    if log_file is None:
        return None
    path = Path(log_file)
    if rank == 0:
        return path
    if not all_ranks:
        return None
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def _file_handler(path: Path, level: int, rank: int) -> logging.Handler:
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    prefix = f"[rank {rank}] " if rank != 0 else ""
    handler.setFormatter(logging.Formatter(prefix + _PLAIN_FORMAT, _DATE_FORMAT))
    handler.setLevel(level)
    return handler
