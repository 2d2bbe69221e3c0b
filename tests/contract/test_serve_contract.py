"""`moe-rl serve` and the launch lines against the installed sglang 0.5.23 itself:

- a `sampling_params` SGLang's JSON contract refuses is refused with SGLang's own words;
- the route-start error is the text of SGLang's scheduler (its f-string, read from the wheel and evaluated);
- the weight-version labels around an in-place push are those SGLang's span code makes of the event its
  scheduler records under the overlap schedule (the token in flight uncounted);
- every launch line, SGLang's and `moe-rl serve`'s, parses with SGLang's ServerArgs, so a flag SGLang does not
  know fails on CPU: every launch config's servers as SGLang servers, and the `moe-rl serve` line, whose
  flags are SGLang's names with SGLang's meanings.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_rl.rollout.engine import SamplingContractError, SamplingParams

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="sglang is not installed (`make venv` installs sglang==0.5.23 --no-deps)")


@pytest.mark.parametrize("params", [
    {"max_new_tokens": 1, "seed": 3}, {"bogus": 1}, {"temperature": "hot"}, {"max_new_tokens": 2.0},
    {"max_new_tokens": 1.5}, {"ignore_eos": "yes"}, {"n": True}, {"top_k": [1]}, {"top_p": {"a": 1}},
    {"sampling_seed": 1.0}, {"skip_special_tokens": 1},
])
def test_sampling_params_sglang_refuses_are_refused_in_its_words(oracle, params):
    theirs = oracle.ask(op="generate", body={"input_ids": [1], "sampling_params": params})
    assert not theirs["ok"]
    with pytest.raises(SamplingContractError) as ours:
        SamplingParams.from_sglang(params)
    assert theirs["error"] == f"ValueError: api/v1 contract: {ours.value}"


@pytest.mark.parametrize("params", [{"temperature": 1, "top_p": 1, "max_new_tokens": 3, "sampling_seed": -1},
                                    {"ignore_eos": True, "no_stop_trim": False, "top_k": -1, "skip_special_tokens": False}])
def test_sampling_params_sglang_takes_are_taken(oracle, params):
    assert oracle.ask(op="generate", body={"input_ids": [1], "sampling_params": params})["ok"]
    SamplingParams.from_sglang(params)


def _scheduler_message(needle: str, module: str = "scheduler", **names) -> str:
    """Evaluate the f-string of sglang's srt/managers/<module>.py that ends with `needle`, with `names` bound."""
    source = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / f"srt/managers/{module}.py"
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.JoinedStr) and isinstance(node.values[-1], ast.Constant) \
                and str(node.values[-1].value).endswith(needle):
            return eval(compile(ast.Expression(node), str(source), "eval"), {"len": len}, names)
    raise AssertionError(f"no f-string with {needle!r} in {source}")


class _Engine:
    tokenizer = None

    def validate(self, req):
        pass


def test_a_route_start_past_the_prompt_is_refused_with_the_schedulers_text():
    from moe_rl.rollout.server.common import BadRequest
    from moe_rl.rollout.server.protocol import parse_generate

    theirs = _scheduler_message("use a smaller routed_experts_start_len.", recv_req=SimpleNamespace(routed_experts_start_len=5),
                                req=SimpleNamespace(origin_input_ids=[1, 2, 3]))
    assert "routed_experts_start_len=5" in theirs
    with pytest.raises(BadRequest) as ours:
        parse_generate({"input_ids": [1, 2, 3], "return_routed_experts": True, "routed_experts_start_len": 5},
                       _Engine(), True)
    assert str(ours.value) == theirs
    theirs = _scheduler_message("Please use a smaller logprob_start_len.",
                                req=SimpleNamespace(logprob_start_len=4, origin_input_ids=[1, 2, 3]))
    with pytest.raises(BadRequest) as ours:
        parse_generate({"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 4}, _Engine(), True)
    assert str(ours.value) == theirs


def test_a_request_past_the_context_is_refused_with_the_tokenizer_managers_text():
    from moe_rl.rollout.server.common import BadRequest
    from moe_rl.rollout.server.protocol import parse_generate

    engine = _Engine()
    engine.max_positions = 8
    for prompt, tokens, needle, names in (
            ([1] * 8, 1, " tokens).", dict(input_token_num=8)),
            ([1] * 5, 4, "fit within the limit.", dict(total_tokens=9, input_token_num=5, max_new_tokens=4))):
        theirs = _scheduler_message(needle, "tokenizer_manager", self=SimpleNamespace(context_len=8), **names)
        with pytest.raises(BadRequest) as ours:
            parse_generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": tokens}}, engine, True)
        assert str(ours.value) == theirs
    parse_generate({"input_ids": [1] * 5, "sampling_params": {"max_new_tokens": 3}}, engine, True)  # fits: taken


@pytest.mark.parametrize("k", [1, 5])
def test_overlap_labels_are_sglangs_spans_of_the_event_its_scheduler_records(oracle, tiny_hf_dir, k):
    """At an in-place pause SGLang's overlap loop holds token k unprocessed: record_weight_version_events
    counts len(output_ids) = k - 1 (no event at all for k = 1: output_ids is empty)."""
    spec = importlib.util.spec_from_file_location("overlap_labels", REPO / "tests/unit/rollout/test_rollout_overlap_labels.py")
    labels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(labels)
    N, _spans = labels.N, labels._spans
    events = [["1", k - 1]] if k > 1 else []
    theirs = oracle.ask(op="weight_versions", events=events, current="2", num_tokens=N)["meta_info"]
    ours = _spans(tiny_hf_dir, k, "in_place", overlap=True)
    assert [(s["version"], s["start"], s["end"]) for s in theirs["weight_versions"]] == ours


def _configs() -> list[Path]:
    return sorted((REPO / "launch/configs").glob("*.yaml"))


@pytest.mark.parametrize("path", _configs(), ids=lambda p: p.stem)
def test_every_launch_configs_servers_parse_with_sglangs_server_args(oracle, path):
    """The GPU servers each launch config asks for (its rollout section with engine=sglang: the same sizes,
    sglang_args and in-place choice), parsed by SGLang; a flag SGLang lacks fails here, not on a GPU node."""
    import dataclasses

    from moe_rl.config import load_config
    from moe_rl.rollout.config import pushes_in_place
    from moe_rl.rollout.launcher import plan_servers

    cfg = load_config(path)
    rollout = dataclasses.replace(cfg.rollout, engine="sglang", urls=[], base_port=31000)
    servers, _ = plan_servers(rollout, "/ckpt")
    for spec in servers:
        fields = oracle.server_args(list(spec.argv))
        assert fields["enable_return_routed_experts"] and fields["model_path"] == "/ckpt"
        assert fields["disable_radix_cache"] is pushes_in_place(rollout)


# moe-rl serve's own flags (no SGLang counterpart): left out before SGLang parses the rest
_OWN_FLAGS = {"--trusted-dir": 1, "--device": 1, "--logprob-mode": 1, "--max-body-mb": 1, "--max-request-tokens": 1,
              "--health-check-timeout": 1}


@pytest.mark.parametrize("inflight", ["in_place", "retract"])
def test_the_moe_rl_serve_line_is_an_sglang_line(oracle, tmp_path, inflight):
    """The `moe-rl serve` line the launcher builds uses SGLang's flag names with SGLang's meanings: parsed
    by SGLang's ServerArgs (moe-rl serve's own flags aside) and by moe-rl serve's parser, they agree."""
    import argparse

    from moe_rl.config import RolloutConfig
    from moe_rl.rollout.launcher import RunIdentity, plan_servers
    from moe_rl.rollout.server import add_arguments

    ident = RunIdentity.for_run(tmp_path / "run", "0.0.0.0", trusted_dirs=[tmp_path])
    cfg = RolloutConfig(engine="local", num_servers=1, host="0.0.0.0", base_port=32000, inflight_update=inflight,
                        colocated=False)
    (spec,), _ = plan_servers(cfg, "/ckpt", identity=ident)
    argv = list(spec.argv[spec.argv.index("serve") + 1:])
    ours = argparse.ArgumentParser()
    add_arguments(ours)
    mine = ours.parse_args(argv)
    shared, i = [], 0
    while i < len(argv):
        skip = _OWN_FLAGS.get(argv[i])
        if skip is not None:
            i += 1 + skip
            continue
        shared.append(argv[i])
        i += 1
    theirs = oracle.server_args(["sglang.launch_server", *shared])
    assert theirs["model_path"] == mine.model == "/ckpt"
    assert (theirs["host"], theirs["port"]) == (mine.host, mine.port) == ("0.0.0.0", 32000)
    assert theirs["enable_return_routed_experts"] is mine.enable_return_routed_experts is True
    assert theirs["disable_radix_cache"] is mine.disable_radix_cache is (inflight == "in_place")
    assert theirs["served_model_name"] == mine.served_model_name == ident.run_id
    assert theirs["api_key"] == ident.keys.api_key and theirs["admin_api_key"] == ident.keys.admin_api_key
