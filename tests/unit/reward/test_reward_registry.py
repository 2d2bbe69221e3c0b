"""Reward registry lookups, user functions by module:function, the toy reward and RewardRunner."""
from __future__ import annotations

import logging

import pytest

from moe_rl.data import Prompt, ToyTokenizer
from moe_rl.reward import (RewardFailure, RewardRunner, get_reward, known_rewards, math_verify,
                           register_reward, toy_exact_match)

TOK = ToyTokenizer()


def half_reward(completion_text, answer):
    """A user reward that declares neither `prompt` nor metadata keywords."""
    return 0.5


class Scorers:
    @staticmethod
    def length(completion_text, answer, *, prompt=None, **metadata):
        return float(len(completion_text)) + metadata.get("bonus", 0)


def flaky(completion_text, answer, **_):
    if completion_text == "bad":
        raise ZeroDivisionError("boom")
    return 1.0


def make_prompt(uid="p0", answer="3", **metadata):
    return Prompt(uid=uid, prompt_ids=[1, 4, 13, 5, 15], prompt_text="1+2=", answer=answer,
                  metadata=metadata)


def test_builtin_names_and_auto():
    assert {"auto", "math", "toy"} <= set(known_rewards())
    assert get_reward("math") is math_verify
    assert get_reward("auto", data="toy:add-easy") is toy_exact_match
    assert get_reward("auto", data="/data/train.parquet") is math_verify
    assert get_reward("auto") is math_verify


def test_unknown_name_lists_known_ones():
    with pytest.raises(KeyError) as err:
        get_reward("maht")
    msg = str(err.value)
    assert "unknown reward 'maht'" in msg and "did you mean 'math'" in msg and "auto, math" in msg


def test_user_function_by_module_path():
    assert get_reward(f"{__name__}:half_reward") is half_reward
    assert get_reward(f"{__name__}:Scorers.length") is Scorers.length


@pytest.mark.parametrize("path,expected", [
    ("no_such_pkg_xyz.rewards:score", "cannot import module 'no_such_pkg_xyz.rewards'"),
    (f"{__name__}:missing_fn", "has no attribute 'missing_fn'"),
    (f"{__name__}:TOK", "not a function"),
    (":score", "expected module:function"),
])
def test_bad_module_paths(path, expected):
    with pytest.raises(ImportError, match=expected):
        get_reward(path)


def test_register_refuses_reserved_and_duplicate_names():
    with pytest.raises(ValueError, match="reserved"):
        register_reward("auto")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math")(half_reward)


@pytest.mark.parametrize("completion_ids,expected", [
    ([TOK.encode("3")[0], TOK.eos_token_id], 1.0),
    ([TOK.encode("3")[0], TOK.eos_token_id, 7, 7], 1.0),  # anything after EOS is ignored
    (TOK.encode("3"), 1.0),  # stopped at max_new_tokens right after the answer
    (TOK.encode("33"), 0.0),
    ([TOK.pad_token_id, TOK.encode("3")[0], TOK.eos_token_id], 0.0),
    ([TOK.eos_token_id], 0.0),
])
def test_toy_reward_on_ids(completion_ids, expected):
    text = TOK.decode(completion_ids)
    assert toy_exact_match(text, "3", completion_ids=completion_ids) == expected


def test_toy_reward_on_text():
    assert toy_exact_match("12<eos>5", "12") == 1.0
    assert toy_exact_match("1 2", "12") == 1.0
    assert toy_exact_match("13<eos>", "12") == 0.0


def test_runner_passes_prompt_ids_and_metadata():
    runner = RewardRunner(Scorers.length, 0.1)
    assert runner.score([make_prompt(bonus=10)], ["abc"]) == [13.0]
    # a function without **kwargs only gets the arguments it declares
    runner = RewardRunner(half_reward, 0.1)
    assert runner.score([make_prompt(bonus=1, prompt="clash")] * 2, ["a", "b"], [[1], [2]]) == [0.5, 0.5]
    assert runner.failures == 0 and runner.total == 2


def test_runner_counts_failures_and_logs(caplog):
    runner = RewardRunner(flaky, max_failure_frac=0.5, min_samples=4)
    with caplog.at_level(logging.WARNING, logger="moe_rl.reward.runner"):
        rewards = runner.score([make_prompt("u1"), make_prompt("u2")], ["bad", "good"])
    assert rewards == [0.0, 1.0]
    assert (runner.failures, runner.total) == (1, 2)
    assert "ZeroDivisionError: boom" in caplog.text and "prompt u1 '1+2='" in caplog.text
    assert "ZeroDivisionError: boom" in runner.first_error


def test_runner_stops_above_threshold_after_min_samples():
    runner = RewardRunner(flaky, max_failure_frac=0.25, min_samples=8)
    p = make_prompt()
    runner.score([p] * 4, ["bad", "bad", "ok", "ok"])  # 50% failed, but only 4 samples seen
    with pytest.raises(RewardFailure) as err:
        runner.score([p] * 4, ["ok"] * 4)  # 2 of 8 = 25% is allowed ...
        runner.score([p] * 2, ["bad", "ok"])  # ... 3 of 10 = 30% is not
    msg = str(err.value)
    assert "flaky" in msg and "3 of 10 samples" in msg and "max_failure_frac=0.25" in msg
    assert "first error: ZeroDivisionError: boom" in msg


def test_runner_treats_bad_return_values_as_failures():
    values = iter([float("nan"), "1.0", None, 1])
    runner = RewardRunner(lambda text, answer: next(values), max_failure_frac=1.0)
    assert runner.score([make_prompt()] * 4, ["x"] * 4) == [0.0, 0.0, 0.0, 1.0]
    assert runner.failures == 3


def test_runner_state_round_trip_and_length_check():
    runner = RewardRunner(flaky, 0.5)
    runner.score([make_prompt()], ["bad"])
    other = RewardRunner(flaky, 0.5)
    other.load_state_dict(runner.state_dict())
    assert (other.failures, other.total, other.first_error) == (1, 1, runner.first_error)
    with pytest.raises(ValueError, match="must match"):
        runner.score([make_prompt()], ["a", "b"])


def test_a_step_of_failing_rewards_logs_one_line_with_counts_and_the_first_reason(caplog):
    """48 samples, 30 failing (raise or return None): one summary line per step naming the counts and
    the first reason, plus the run's first traceback once, not a line per sample."""
    def sometimes(text, answer):
        if text.startswith("raise"):
            raise KeyError("no field")
        return None if text.startswith("none") else 1.0

    runner = RewardRunner(sometimes, max_failure_frac=1.0)
    texts = ["raise"] * 10 + ["none"] * 20 + ["ok"] * 18
    prompts = [make_prompt(f"u{i}") for i in range(len(texts))]
    with caplog.at_level(logging.WARNING, logger="moe_rl.reward.runner"):
        runner.score(prompts, texts)
        first = [r.getMessage() for r in caplog.records]
        traceback = caplog.records[0].exc_info
        caplog.clear()
        runner.score(prompts, texts)
        second = [r.getMessage() for r in caplog.records]
    assert len(first) == 2 and "first failure of the run" in first[0] and traceback[0] is KeyError
    summary = first[1]
    assert "failed on 30 of 48 samples" in summary and "(30 failures in 48 samples so far)" in summary
    assert "first: KeyError: 'no field' (on prompt u0" in summary
    assert len(second) == 1 and "failed on 30 of 48 samples" in second[0] and "60 failures in 96" in second[0]
