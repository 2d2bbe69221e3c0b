"""Rank-aware logging: rank 0 speaks, other ranks only warn, all_ranks prefixes every line."""
from __future__ import annotations

import logging

import pytest

from moe_rl.observe.logging import ROOT_LOGGER, get_logger, parse_level, setup_logging


@pytest.fixture(autouse=True)
def restore_moe_rl_logger():
    """setup_logging changes process-wide state; give other tests the logger back as it was."""
    logger = logging.getLogger(ROOT_LOGGER)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    for handler in list(logger.handlers):
        if handler not in saved[0]:
            logger.removeHandler(handler)
            handler.close()
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def test_rank0_logs_to_console_and_file(tmp_path, capsys):
    log_file = tmp_path / "logs" / "train.log"
    setup_logging("info", rank=0, log_file=log_file)
    get_logger("trainer").debug("hidden detail")
    get_logger("trainer").info("step done")
    out = capsys.readouterr().out
    assert "step done" in out and "moe_rl.trainer" in out and "hidden detail" not in out
    assert "[rank" not in out
    text = log_file.read_text()
    assert "step done" in text and "hidden detail" not in text


def test_other_ranks_show_only_warnings(tmp_path, capsys):
    setup_logging("info", rank=2, log_file=tmp_path / "train.log")
    log = get_logger("moe_rl.recipes.rl.step")
    log.info("chatty")
    log.warning("slow rank")
    log.error("broken")
    captured = capsys.readouterr()
    assert "chatty" not in captured.out + captured.err
    assert "[rank 2]" in captured.err and "slow rank" in captured.err and "broken" in captured.err
    assert list(tmp_path.iterdir()) == []  # only rank 0 writes the log file


def test_all_ranks_prefixes_and_splits_files(tmp_path, capsys):
    setup_logging("debug", rank=1, all_ranks=True, log_file=tmp_path / "train.log")
    get_logger("x").debug("where am I")
    assert "[rank 1]" in capsys.readouterr().err
    assert "where am I" in (tmp_path / "train.rank1.log").read_text()


def test_all_ranks_prefixes_rank0_too(capsys):
    setup_logging("info", rank=0, all_ranks=True)
    get_logger("x").info("hello")
    assert "[rank 0]" in capsys.readouterr().out


def test_setup_twice_does_not_duplicate_lines(capsys):
    setup_logging("info", rank=0)
    setup_logging("info", rank=0)
    get_logger("x").info("once")
    assert capsys.readouterr().out.count("once") == 1


def test_level_names():
    assert parse_level("DEBUG") == logging.DEBUG and parse_level("warning") == logging.WARNING
    assert parse_level(15) == 15
    with pytest.raises(ValueError, match="unknown log level"):
        parse_level("loud")


def test_get_logger_namespaces_under_moe_rl():
    assert get_logger("trainer").name == "moe_rl.trainer"
    assert get_logger("moe_rl.observe.sinks").name == "moe_rl.observe.sinks"
    assert get_logger("moe_rl").name == "moe_rl"
