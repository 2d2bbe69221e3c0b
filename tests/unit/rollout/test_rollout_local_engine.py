"""LocalEngine against a plain HF forward: exact log-probs and routes, seeds, stops, weight updates."""
from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest
import torch

from moe_rl.rollout.engine import GenerateRequest, SamplingParams
from moe_rl.rollout.local_engine import LocalEngine


def hf_reference(model, prompt: list[int], output: list[int],
                 temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """log_softmax(logits / T) of `output` and top-k routes of every token but the last, from one HF forward."""
    seq = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        out = model(seq, output_router_logits=True)
    lp = torch.log_softmax(out.logits[0].float() / temperature, dim=-1)
    P = len(prompt)
    logprobs = lp[P - 1:-1].gather(1, torch.tensor(output).view(-1, 1)).view(-1).numpy()
    k = model.config.num_experts_per_tok
    routes = torch.stack([torch.topk(torch.softmax(r.float(), -1), k, dim=-1).indices
                          for r in out.router_logits], dim=1)[:-1]
    return logprobs, routes.numpy()


@pytest.fixture(scope="module")
def engine(tiny_hf_dir):
    eng = LocalEngine(tiny_hf_dir, seed=0, max_batch=8)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf_model(tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [40, 41, 42, 43, 44]]


def test_logprobs_and_routes_match_hf_forward(engine, hf_model):
    reqs = [GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=12, n=2, seed=1)),
            GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=9, top_k=8, top_p=0.9, temperature=0.8)),
            GenerateRequest(PROMPTS[2], SamplingParams(max_new_tokens=6, temperature=0.0))]
    out = engine.generate(reqs)
    assert [len(r) for r in out] == [2, 1, 1]
    for req, results in zip(reqs, out):
        for res in results:
            assert res.prompt_ids == list(req.prompt_ids) and res.finish_reason in ("length", "stop")
            # tempered log-probs (greedy counts as T = 1), before the top-k / top-p truncation
            temperature = req.sampling.temperature if not req.sampling.greedy else 1.0
            lp, routes = hf_reference(hf_model, res.prompt_ids, res.output_ids, temperature)
            assert res.output_logprobs.dtype == np.float32
            np.testing.assert_allclose(res.output_logprobs, lp, atol=1e-4, rtol=0)
            assert res.routed_experts.shape == (len(res.token_ids) - 1, 4, 2)
            assert res.routed_experts.dtype == np.uint8
            np.testing.assert_array_equal(res.routed_experts.astype(np.int64), routes)


def test_greedy_is_argmax(engine, hf_model):
    (res,), = engine.generate([GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=5, temperature=0,
                                                                           ignore_eos=True))])
    seq = list(PROMPTS[0])
    for t in res.output_ids:
        with torch.no_grad():
            nxt = int(hf_model(torch.tensor([seq])).logits[0, -1].argmax())
        assert t == nxt
        seq.append(t)


def test_seeds_reproduce_and_samples_differ(engine):
    sp = SamplingParams(max_new_tokens=10, n=3, seed=123, ignore_eos=True)
    a = engine.generate([GenerateRequest(PROMPTS[1], sp)])[0]
    # same seed, other batch company -> same samples; sample j == a single request with seed + j
    b = engine.generate([GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=4)),
                         GenerateRequest(PROMPTS[1], sp)])[1]
    c = engine.generate([GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=10, seed=125, ignore_eos=True))])[0]
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert c[0].output_ids == a[2].output_ids
    assert len({tuple(r.output_ids) for r in a}) == 3


def test_stop_tokens_and_lengths(engine):
    (free,), = engine.generate([GenerateRequest(PROMPTS[2], SamplingParams(max_new_tokens=8, seed=7,
                                                                            ignore_eos=True))])
    assert free.finish_reason == "length" and len(free.output_ids) == 8
    stop = free.output_ids[3]
    first = free.output_ids.index(stop)
    (res,), = engine.generate([GenerateRequest(PROMPTS[2], SamplingParams(max_new_tokens=8, seed=7,
                                                                           stop_token_ids=[stop]))])
    # the stop token ends the sample and is its last token (SGLang keeps it in output_ids)
    if 2 not in free.output_ids[:first + 1]:  # EOS (id 2) would have stopped it earlier
        assert res.finish_reason == "stop" and res.output_ids == free.output_ids[:first + 1]
    (zero,), = engine.generate([GenerateRequest(PROMPTS[2], SamplingParams(max_new_tokens=0))])
    assert zero.output_ids == [] and zero.finish_reason == "length"
    assert zero.routed_experts.shape == (len(PROMPTS[2]) - 1, 4, 2)


def test_pause_abort_ends_inflight_samples(engine):
    results = {}
    t = threading.Thread(target=lambda: results.update(
        out=engine.generate([GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=400, ignore_eos=True))])))
    t.start()
    deadline = time.monotonic() + 30
    while not engine._gen_lock.locked() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    engine.pause_generation("abort")
    t.join(60)
    engine.continue_generation()
    (res,), = results["out"]
    assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 400
    assert res.routed_experts.shape[0] == len(res.token_ids) - 1
    (again,), = engine.generate([GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=3))])
    assert again.finish_reason in ("length", "stop")


def test_update_weights_from_tensors(engine, hf_model, tiny_hf_dir):
    from safetensors.torch import load_file

    sd = load_file(str(tiny_hf_dir / "model.safetensors"))
    gate = "model.layers.1.mlp.experts.2.gate_proj.weight"   # checkpoint (per-expert) name
    router = "model.layers.1.mlp.gate.weight"                # runtime name
    new = {gate: sd[gate] * -1.0, router: sd[router].flip(0)}
    with pytest.raises(ValueError, match="unknown parameter"):
        engine.update_weights_from_tensors({**new, "model.layers.9.nope": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights_from_tensors({router: torch.zeros(3, 3)})
    try:
        engine.update_weights_from_tensors(new, version="t1")
        fused = dict(engine.model.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
        I = sd[gate].shape[0]
        torch.testing.assert_close(fused[2, :I], new[gate])
        (res,), = engine.generate([GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=6, seed=3))])
        assert res.weight_version == "t1"
        ref_model = type(hf_model)(hf_model.config).eval()
        ref_model.load_state_dict(engine.model.state_dict())
        lp, routes = hf_reference(ref_model, res.prompt_ids, res.output_ids)
        np.testing.assert_allclose(res.output_logprobs, lp, atol=1e-4, rtol=0)
        np.testing.assert_array_equal(res.routed_experts.astype(np.int64), routes)
    finally:
        engine.update_weights_from_tensors({gate: sd[gate], router: sd[router]}, version="default")


def test_update_weights_refuses_incomplete_checkpoint(engine, tiny_hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "missing"
    shutil.copytree(tiny_hf_dir, bad)
    sd = load_file(str(bad / "model.safetensors"))
    sd.pop("model.layers.2.mlp.gate.weight")
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    before = engine.generate([GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=5, seed=9))])[0][0]
    with pytest.raises(ValueError, match="missing_keys"):
        engine.update_weights(str(bad), version="bad")
    after = engine.generate([GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=5, seed=9))])[0][0]
    assert after.output_ids == before.output_ids and after.weight_version == before.weight_version
    np.testing.assert_array_equal(after.output_logprobs, before.output_logprobs)


def test_dense_layers_are_skipped_and_dense_models_have_no_routes(tmp_path):
    from transformers import AutoModelForCausalLM

    from moe_rl.testing import TinyMoEConfig, make_tiny_qwen3_moe

    mixed = make_tiny_qwen3_moe(tmp_path / "mixed", config=TinyMoEConfig(mlp_only_layers=[1]))
    eng = LocalEngine(mixed)
    assert eng.moe_layer_ids == [0, 2, 3] and eng.num_hidden_layers == 4
    (res,), = eng.generate([GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=5, seed=1))])
    model = AutoModelForCausalLM.from_pretrained(mixed, dtype=torch.float32).eval()
    lp, routes = hf_reference(model, res.prompt_ids, res.output_ids)  # router_logits: MoE layers only
    assert res.routed_experts.shape == (len(res.token_ids) - 1, 3, 2)
    np.testing.assert_array_equal(res.routed_experts.astype(np.int64), routes)
    np.testing.assert_allclose(res.output_logprobs, lp, atol=1e-4, rtol=0)
    eng.close()
    dense = make_tiny_qwen3_moe(tmp_path / "dense", config=TinyMoEConfig(mlp_only_layers=[0, 1, 2, 3]))
    eng = LocalEngine(dense)
    (res,), = eng.generate([GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=3))])
    assert eng.moe_layer_ids == [] and res.routed_experts is None and len(res.output_ids) == 3
    eng.close()


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_push_under_a_paused_sample_in_place_keeps_its_cache_and_a_retract_prefills_it_again(
        tiny_hf_dir, tmp_path, mode):
    # the sample's first tokens come from the old weights, the rest from the new; after a retract the
    # rest are exactly the new weights' (a fresh prefill of prompt + output so far), and every route
    # is the new weights', as SGLang's re-prefill captures them; in place, the rest attend to keys
    # and values the old weights computed, so they are neither version's
    from transformers import AutoModelForCausalLM

    from moe_rl.testing import make_tiny_qwen3_moe

    new_dir = make_tiny_qwen3_moe(tmp_path / "new", seed=1)
    old_model, new_model = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
                            for d in (tiny_hf_dir, new_dir))
    eng = LocalEngine(tiny_hf_dir, seed=0, max_batch=8, weight_version="1")
    try:
        results = {}
        t = threading.Thread(target=lambda: results.update(out=eng.generate([GenerateRequest(
            PROMPTS[1], SamplingParams(max_new_tokens=300, ignore_eos=True, seed=3), return_routed_experts=True)])))
        t.start()
        deadline = time.monotonic() + 30
        while not eng._gen_lock.locked() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        eng.pause_generation(mode)
        assert eng.busy == (mode == "in_place")  # a retracted sample holds no cache: a flush may follow
        eng.update_weights_from_disk(new_dir, version="2")
        eng.continue_generation()
        t.join(60)
    finally:
        eng.close()
    (res,), = results["out"]
    (v1, _, split), (v2, start, end) = res.weight_versions
    assert (v1, v2, start, end) == ("1", "2", split, 300) and 0 < split < 300
    assert res.num_retractions == (1 if mode == "retract" else 0)
    old_lp, old_routes = hf_reference(old_model, res.prompt_ids, res.output_ids)
    new_lp, new_routes = hf_reference(new_model, res.prompt_ids, res.output_ids)
    np.testing.assert_allclose(res.output_logprobs[:split], old_lp[:split], atol=1e-4, rtol=0)
    gap = np.abs(res.output_logprobs[split + 1:] - new_lp[split + 1:]).max()
    routes = res.routed_experts.astype(np.int64)
    if mode == "retract":  # one version computed every position: each route is that version's choice
        assert gap <= 1e-4
        np.testing.assert_array_equal(routes, new_routes)
    else:  # the positions computed before the push are the old version's, token by token
        assert gap > 1e-3, gap  # the old weights' cache is still attended to
        before = len(res.prompt_ids) - 1 + split
        np.testing.assert_array_equal(routes[:before], old_routes[:before])


class _PushOnEntry:
    """The engine's lock, which on the n-th entry by the generating thread first runs `push` (a retract
    pause, a weight update, continue) in that thread: a retract landing after the decode loop passed
    its park and before the forward took the lock, deterministically."""

    def __init__(self, lock, n: int, push):
        self.lock, self.n, self.push, self.entries = lock, n, push, 0

    def __enter__(self):
        self.entries += 1
        if self.entries == self.n:
            self.push()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_a_retract_landing_between_the_park_and_the_forward_prefills_again(tiny_hf_dir, tmp_path):
    # prefill (1st entry), sample token 1, pass the park, then the retract + push lands before the
    # decode forward takes the lock (2nd entry): the cache that forward would extend is gone. A row
    # finishing on the next token must still have every route and its last log-prob from the new
    # weights alone (the old loop ran that forward on the old cache and kept the prompt's old routes).
    from transformers import AutoModelForCausalLM

    from moe_rl.testing import make_tiny_qwen3_moe

    new_dir = make_tiny_qwen3_moe(tmp_path / "new", seed=1)
    new_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    eng = LocalEngine(tiny_hf_dir, seed=0, max_batch=8, weight_version="1")

    def push():
        eng.pause_generation("retract")
        eng.update_weights_from_disk(new_dir, version="2")
        eng.continue_generation()

    eng._lock = _PushOnEntry(eng._lock, 2, push)
    try:
        (res,), = eng.generate([GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=2, ignore_eos=True, seed=3),
                                                return_routed_experts=True)])
    finally:
        eng.close()
    assert [v for v, _, _ in res.weight_versions] == ["1", "2"] and res.num_retractions == 1
    new_lp, new_routes = hf_reference(new_model, res.prompt_ids, res.output_ids)
    np.testing.assert_array_equal(res.routed_experts.astype(np.int64), new_routes)
    np.testing.assert_allclose(res.output_logprobs[1:], new_lp[1:], atol=1e-4, rtol=0)


class _HalfPushOnEntry:
    """The engine's lock, which on the generating (main) thread's n-th entry first pauses the engine
    and loads the first half of the new weights, and leaves the second half and continue_generation()
    to a pusher thread 0.3 s later: a prefill reaching the lock in the middle of a push."""

    def __init__(self, lock, n: int, first, rest):
        self.lock, self.n, self.first, self.rest, self.entries, self.pushing = lock, n, first, rest, 0, False

    def __enter__(self):
        if not self.pushing and threading.current_thread() is threading.main_thread():
            self.entries += 1
            if self.entries == self.n:
                self.pushing = True
                self.first()
                threading.Timer(0.3, self.rest).start()
                self.pushing = False
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_a_prefill_waits_out_a_push_that_paused_between_its_buckets(tiny_hf_dir, tmp_path):
    # One sample per chunk (max_batch=1), one token each: the second chunk's prefill reaches the lock
    # after the push paused and loaded half its tensors. It must wait for the whole push (as SGLang
    # runs no forward while paused) and compute the sample on the new weights alone; before, it ran
    # on half-new weights under the new version's label and retract count, and no retract redid it.
    from transformers import AutoModelForCausalLM

    from moe_rl.testing import make_tiny_qwen3_moe

    new_dir = make_tiny_qwen3_moe(tmp_path / "new", seed=1)
    new_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    named = list(new_model.state_dict().items())
    eng = LocalEngine(tiny_hf_dir, seed=0, max_batch=1, weight_version="1")

    def first_half():
        eng.pause_generation("retract")
        eng.update_weights_from_tensors(named[: len(named) // 2], version="2")

    def second_half():
        eng.update_weights_from_tensors(named[len(named) // 2:], version="2")
        eng.continue_generation()

    eng._lock = _HalfPushOnEntry(eng._lock, 2, first_half, second_half)
    try:
        short, long = eng.generate([GenerateRequest(p, SamplingParams(max_new_tokens=1, ignore_eos=True, seed=3),
                                                    return_routed_experts=True) for p in (PROMPTS[1], PROMPTS[0])])
    finally:
        eng.close()
    assert short[0].weight_version == "1"          # the first chunk, before the push
    (res,) = long                                   # the second chunk: prefilled during the push
    assert res.weight_version == "2"
    new_lp, new_routes = hf_reference(new_model, res.prompt_ids, res.output_ids)
    np.testing.assert_array_equal(res.routed_experts.astype(np.int64), new_routes)
    np.testing.assert_allclose(res.output_logprobs, new_lp, atol=1e-4, rtol=0)
