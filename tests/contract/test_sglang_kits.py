"""SGLang 0.5.23's own HTTP test kits, from the installed wheel, pass against `moe-rl serve` (sglang_kits.py runs
them in a subprocess against a real `moe-rl serve` process on a tiny model with a real tokenizer).

Run: BasicAPIContractMixin (health, health_generate, server and model info, OpenAI chat and completions),
PauseResumeInPlaceMixin, AbortAllMixin, MatchedStopMixin (finish by length), BasicDecodeCorrectnessMixin
(temperature-0 determinism, one-token output, ASCII output, no repetition blow-up), and cache_hit_kit's multi-turn cache-hit run
(over a local ShareGPT-format file, as the kit reads one; nothing is downloaded). Skipped, with the reason
(sglang_kits.py): the knowledge probes of a trained model, the stop-string / EOS /
regex checks that need a chosen string in a random model's greedy text or regex stops. Not run at all:
WaitingTimeoutMixin and RunningTimeoutTwoWaveMixin (SGLang's SGLANG_REQ_*_TIMEOUT queue timeouts, which
moe-rl serve does not have), streaming_session_kit (/open_session sessions), prefix_cache_branching_kit
(a hybrid model's chunk-aligned cache), radix_cache_server_kit (400 prompts of a 32k vocabulary: hours on
2 cores), basic_scheduler_stress_kit (world knowledge, 36k-token prompts), the grammar, reasoning, VLM,
spec-decoding, Anthropic, eval and benchmark kits.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).with_name("sglang_kits.py")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="sglang is not installed (`make venv` installs sglang==0.5.23 --no-deps)")

PASSING = {
    "TestBasicAPIContract.test_health", "TestBasicAPIContract.test_health_generate",
    "TestBasicAPIContract.test_get_server_info", "TestBasicAPIContract.test_get_model_info",
    "TestBasicAPIContract.test_openai_chat_completion", "TestBasicAPIContract.test_openai_completion",
    "TestPauseResumeInPlace.test_pause_resume_in_place", "TestAbortAll.test_abort_all",
    "TestMatchedStop.test_finish_length", "TestDecodeCorrectness.test_determinism_temp_zero",
    "TestDecodeCorrectness.test_max_token_one", "TestDecodeCorrectness.test_ascii_ratio",
    "TestDecodeCorrectness.test_no_repetition_blowup",
    "TestMultiturnCacheHit.test_multiturn_cache_hit",
}

_TEXTS = ["How do rivers form their banks over long stretches of time?", "Name three uses of copper wire.",
          "Describe a quiet morning in a small fishing harbour.", "Why do cats sleep so much during the day?",
          "List the steps to brew a cup of tea properly.", "What makes a bridge strong enough for trains?",
          "Explain how a bicycle stays upright while moving.", "Write two lines about autumn leaves falling."]


def test_sglang_kits_pass_against_moe_rl_serve(tmp_path):
    from moe_rl.testing import TinyMoEConfig, make_tiny_qwen3_moe
    from moe_rl.testing.serve import start_serve_process, stop_process
    from moe_rl.testing.tokenizer import add_tiny_tokenizer

    # 2048 positions: AbortAllMixin asks for 1500 new tokens after its prompt
    model = add_tiny_tokenizer(make_tiny_qwen3_moe(tmp_path / "model", seed=0,
                                                   config=TinyMoEConfig(max_position_embeddings=2048)))
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps([{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": q[::-1]}]}
                                   for q in _TEXTS]))
    srv = start_serve_process(model)
    try:
        done = subprocess.run([sys.executable, str(RUNNER), srv.url, str(model), str(srv.proc.pid), str(dataset)],
                              capture_output=True, text=True, timeout=600)
    finally:
        stop_process(srv.proc)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-4000:]
    outcome = {k.rsplit(".", 2)[-2] + "." + k.rsplit(".", 1)[-1]: v
               for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    failed = {k: v for k, v in outcome.items() if v.startswith("FAIL")}
    assert not failed, json.dumps(failed, indent=1)
    assert {k for k, v in outcome.items() if v == "ok"} == PASSING, outcome
