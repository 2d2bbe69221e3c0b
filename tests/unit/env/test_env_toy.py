"""The environment registry and the built-in toy environments (moe_rl/env/)."""
from __future__ import annotations

import sys

import pytest

from moe_rl.data.dataset import load_dataset
from moe_rl.data.toy import ToyTokenizer
from moe_rl.env import Turn, make_env
from moe_rl.env.toy import CALL

TOK = ToyTokenizer()
EOS = TOK.eos_token_id


def _prompt(a: int, b: int):
    return next(p for p in load_dataset("toy:add-medium") if p.metadata["a"] == a and p.metadata["b"] == b)


def test_calculator_answers_a_call_with_the_sum_and_pays_the_answer_after_it():
    env = make_env("calculator", eos_id=EOS, vocab_size=17)()
    assert env.reset(_prompt(3, 4)) == [] and tuple(env.stop_token_ids) == (CALL,)
    call = env.step([CALL])
    assert call == Turn(observation=TOK.encode("7"), reward=0.2, info={"calls": 1})
    assert env.step(TOK.encode("7") + [EOS]) == Turn(reward=1.0, done=True, info={"calls": 1})
    env.reset(_prompt(3, 4))
    env.step([CALL])
    assert env.step(TOK.encode("7")).reward == 1.0  # a turn cut by max_new_tokens is judged as it stands
    env.reset(_prompt(3, 4))
    env.step([CALL])
    assert env.step(TOK.encode("8") + [EOS]).reward == 0.0


def test_calculator_needs_the_call_and_allows_one():
    env = make_env("calculator", eos_id=EOS)()
    env.reset(_prompt(2, 2))
    assert env.step(TOK.encode("4") + [EOS]) == Turn(reward=0.0, done=True, info={"calls": 0})  # no call: no pay
    free = make_env("calculator", eos_id=EOS, require_call=False)()
    free.reset(_prompt(2, 2))
    assert free.step(TOK.encode("4")).reward == 1.0
    env.reset(_prompt(2, 2))
    env.step([CALL])
    assert env.step([CALL]).done  # a second call ends the episode unanswered


def test_calculator_refuses_a_vocabulary_without_its_token():
    with pytest.raises(ValueError, match="model.tiny.vocab_size >= 17"):
        make_env("calculator", eos_id=EOS, vocab_size=16)


def test_guess_gives_higher_or_lower_until_found():
    env = make_env("guess", eos_id=EOS)()
    env.reset(_prompt(3, 2))  # the secret is the answer, 5
    assert env.step(TOK.encode("2") + [EOS]) == Turn(observation=TOK.encode("+"))
    assert env.step(TOK.encode("8") + [EOS]) == Turn(observation=TOK.encode("-"))
    assert env.step(TOK.encode("5") + [EOS]) == Turn(reward=1.0, done=True)
    assert env.step([TOK.encode("+")[0], EOS]).done  # not a number: the game ends


class _MyEnv:
    stop_token_ids = ()

    def __init__(self, eos_id, tokenizer=None):
        self.eos_id = eos_id

    def reset(self, prompt):
        return [5]

    def step(self, ids):
        return Turn(reward=1.0, done=True)


class _NotAnEnv:
    def __init__(self):
        pass


def test_registry_takes_module_class_and_names_what_is_wrong(monkeypatch):
    monkeypatch.setitem(sys.modules, "my_envs", type(sys)("my_envs"))
    sys.modules["my_envs"].MyEnv, sys.modules["my_envs"].Bad = _MyEnv, _NotAnEnv
    env = make_env("my_envs:MyEnv", eos_id=EOS, vocab_size=17, tokenizer=TOK)()  # given only what it declares
    assert env.eos_id == EOS and env.reset(None) == [5]
    with pytest.raises(KeyError, match="did you mean 'calculator'"):
        make_env("calculater")
    with pytest.raises(ImportError, match="cannot import 'no_such_module'"):
        make_env("no_such_module:Env")
    with pytest.raises(ImportError, match="has no attribute 'Missing'"):
        make_env("my_envs:Missing")
    with pytest.raises(TypeError, match="lacks reset, step"):
        make_env("my_envs:Bad")


def test_the_docs_environment_plays_as_documented():
    """docs/guide/multi-turn.md: the example class, played against the toy tokenizer's ids."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "guide" / "multi-turn.md").read_text()
    marker = "<!-- tests/unit/env/test_env_toy.py plays this class -->"
    code = re.search(r"```python\n(.*?)```", text[text.index(marker):], re.S).group(1)
    space: dict = {}
    exec(compile(code, "multi-turn.md", "exec"), space)  # noqa: S102 - the docs' own example
    env = space["Countdown"](EOS, TOK)
    env.reset(_prompt(1, 1))  # answer 2: say 2, 1, 0
    turns = [env.step(TOK.encode(d) + [EOS]) for d in "210"]
    assert [t.reward for t in turns] == [0.25] * 3 and [t.done for t in turns] == [False, False, True]
    assert turns[0].observation == TOK.encode("-")
    env.reset(_prompt(1, 1))
    assert env.step(TOK.encode("3") + [EOS]) == Turn(done=True)
