"""SGLang 0.5.23's own HTTP test kits (sglang/test/kits, imported from the installed wheel) against a running
server: `python sglang_kits.py URL MODEL_DIR PID DATASET` prints one JSON line, {test id: "ok" | "FAIL: ..." |
"skip: why"}.

Run by test_sglang_kits.py in a subprocess of its own: the kits' package imports sglang, whose import chain
needs triton and torchvision, stubbed here as sglang_oracle.py stubs them (never in the test session). The
kits are mixins of unittest test cases that read `base_url` and `process`; their knobs (request counts,
lengths, sleeps) are sized for two CPU cores and a tiny model. A kit test that needs what a tiny random model
cannot have (world knowledge, a chosen stop string in its greedy text) or a feature `moe-rl serve` does not
offer is skipped with the reason, never changed.
"""
from __future__ import annotations

import json
import os
import sys
import unittest
from pathlib import Path


def _install_stubs() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import sglang_oracle  # noqa: E402  (its stubs: triton, torchvision)

    import torch._dynamo.repro.after_dynamo  # noqa: F401
    import torch._inductor.runtime.triton_compat  # noqa: F401
    import torch.utils.flop_counter  # noqa: F401

    class Stubs(sglang_oracle._StubFinder):
        """sglang_oracle's stubs, and HF `datasets` (imported by sglang.benchmark.datasets for its MMMU and
        other loaders, which cache_hit_kit's random-request sampler never calls)."""

        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in (*sglang_oracle.STUBBED, "datasets"):
                import importlib.machinery

                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

    sys.meta_path.insert(0, Stubs())


class _Process:
    """The server process as the kits see it (`self.process.poll()`: None while it runs)."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self):
        try:
            os.kill(self.pid, 0)
        except OSError:
            return 1
        return None


def _cases(url: str, model: str, pid: int, dataset: str) -> list[type]:
    from sglang.test.kits.abort_timeout_kit import AbortAllMixin
    from sglang.test.kits.basic_api_contract_kit import BasicAPIContractMixin
    from sglang.test.kits.basic_decode_correctness_kit import BasicDecodeCorrectnessMixin
    from sglang.test.kits.cache_hit_kit import run_multiturn_cache_hit_test
    from sglang.test.kits.matched_stop_kit import MatchedStopMixin
    from sglang.test.kits.pause_generation_kit import PauseResumeInPlaceMixin

    def skip(why: str):
        return unittest.skip(why)(lambda self: None)

    class Server(unittest.TestCase):
        base_url, process = url, _Process(pid)

    class TestBasicAPIContract(BasicAPIContractMixin, Server):
        pass

    class TestPauseResumeInPlace(PauseResumeInPlaceMixin, Server):
        pause_num_requests, pause_max_new_tokens, pause_duration, pause_ignore_eos = 4, 300, 1.0, True

    class TestAbortAll(AbortAllMixin, Server):
        abort_all_num_requests, abort_all_max_new_tokens, abort_all_sleep = 4, 1500, 0.5

    class TestMatchedStop(MatchedStopMixin, Server):
        model = "default"
        test_finish_stop_regex_str = skip("stop_regex: moe-rl serve refuses it (400), no regex stops")
        test_finish_stop_str = skip("needs a newline in a random tiny model's greedy text")
        test_finish_stop_eos = skip("needs an EOS in a random tiny model's greedy text")

    class TestDecodeCorrectness(BasicDecodeCorrectnessMixin, Server):
        sanity_max_new_tokens_short, sanity_max_new_tokens_long = 16, 32
        test_capital_france = skip("world knowledge: a random tiny model has none")
        test_basic_math = skip("world knowledge: a random tiny model has none")
        test_color_completion = skip("world knowledge: a random tiny model has none")

    class TestMultiturnCacheHit(Server):
        def test_multiturn_cache_hit(self):
            result = run_multiturn_cache_hit_test(url, model, num_clients=2, num_rounds=3, request_length=24,
                                                  output_length=6, dataset_path=dataset, max_parallel=2)
            self.assertGreater(result["overall"]["cache_hit_rate"], 0.3)

    return [TestBasicAPIContract, TestPauseResumeInPlace, TestAbortAll, TestMatchedStop, TestDecodeCorrectness,
            TestMultiturnCacheHit]


class _Result(unittest.TextTestResult):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.outcome: dict[str, str] = {}

    def addSuccess(self, test):
        super().addSuccess(test)
        self.outcome[test.id()] = "ok"

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.outcome[test.id()] = "FAIL: " + self._exc_info_to_string(err, test)[-1500:]

    def addError(self, test, err):
        super().addError(test, err)
        self.outcome[test.id()] = "FAIL: " + self._exc_info_to_string(err, test)[-1500:]

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.outcome[test.id()] = f"skip: {reason}"


def main() -> int:
    url, model, pid, dataset = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    out = sys.stdout
    sys.stdout = sys.stderr  # the kits print; the reply is the last line of stdout alone
    _install_stubs()
    suite = unittest.TestSuite()
    for case in _cases(url, model, pid, dataset):
        suite.addTests(unittest.defaultTestLoader.loadTestsFromTestCase(case))
    result = unittest.TextTestRunner(stream=sys.stderr, resultclass=_Result, verbosity=2).run(suite)
    print(json.dumps(result.outcome), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
