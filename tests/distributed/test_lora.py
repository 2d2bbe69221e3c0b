"""LoRA on the megatron policy (moe_rl/policy/lora.py) against HF transformers + PEFT on the same base
and adapter (attention through target_modules, every routed expert through target_parameters): the
single-process forward and the adapter's gradient, then each layout against the single process."""
from __future__ import annotations

import pytest
import torch

from moe_rl.policy.parity import compare, sample_sequences
from moe_rl.testing import run_ranks
from moe_rl.testing.lora import lora_worker, merged_state, peft_adapter, peft_model, peft_reference

RANK, ALPHA = 4, 8.0
LAYOUTS = ["tp2", "tp2-ep2", "pp2", "dp2"]  # tp2: sequence parallel on (the layout's default)


@pytest.fixture(scope="module")
def sequences():
    return sample_sequences(vocab_size=128, num=6, max_len=16, seed=3)


@pytest.fixture(scope="module")
def reference(tiny_hf_dir, sequences):
    model = peft_model(str(tiny_hf_dir), RANK, ALPHA, seed=1)
    adapter = peft_adapter(model)
    logp, grads = peft_reference(model, sequences)
    return adapter, logp, grads


@pytest.fixture(scope="module")
def single(tiny_hf_dir, sequences, reference):
    (res,) = run_ranks(lora_worker, 1, "single", str(tiny_hf_dir), sequences, reference[0], RANK, ALPHA)
    return res


def _grad_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-12)) for k in got}


def test_a_lora_d_megatron_forward_and_gradient_equal_hf_with_peft(single, reference):
    adapter, logp, grads = reference
    mx, _ = compare([single], logp)
    assert mx <= 1e-4  # fp32, as check-parity
    assert set(single["grads"]) == set(grads) == set(adapter)  # every projection and expert adapted
    errors = _grad_errors(single["grads"], grads)
    assert max(errors.values()) <= 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    assert single["trainable_base"] == 0  # the base is frozen


def test_the_adapter_changes_the_output(tiny_hf_dir, sequences, single):
    from moe_rl.policy.parity import hf_logprobs

    mx, _ = compare([single], hf_logprobs(tiny_hf_dir, sequences))
    assert mx > 1e-2  # so the parity above is the adapter's, not the base's


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_give_the_single_process_log_probs_and_adapter_gradients(layout, tiny_hf_dir, sequences,
                                                                         reference, single, tmp_path):
    from moe_rl.policy.parallel import ParallelLayout

    world = ParallelLayout.parse(layout).world_size
    peft_dir = tmp_path / "adapter"
    results = run_ranks(lora_worker, world, layout, str(tiny_hf_dir), sequences, reference[0], RANK, ALPHA,
                        timeout=600, peft_dir=str(peft_dir) if layout == "tp2-ep2" else None)
    mx, _ = compare(results, reference[1])
    assert mx <= 1e-4
    if layout == "tp2-ep2":  # the adapter written in PEFT's format is the one it was given, as PEFT loads it
        import peft
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32)
        loaded = peft_adapter(peft.PeftModel.from_pretrained(base, str(peft_dir)))
        assert set(loaded) == set(reference[0])
        assert all(torch.equal(loaded[k], reference[0][k]) for k in loaded)
    grads = {}
    for r in results:
        grads.update(r["grads"])
    assert set(grads) == set(single["grads"])
    errors = _grad_errors(grads, single["grads"])
    assert max(errors.values()) <= 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    from moe_rl.testing import make_tiny_mixtral

    # no load-balancing loss: megatron adds its gradient in the backward, HF's forward alone has none
    return make_tiny_mixtral(tmp_path_factory.mktemp("lora_mixtral"), seed=0, router_aux_loss_coef=0.0)


def test_mixtral_in_tp2_ep2_equals_hf_with_peft_and_exports_the_merged_model(mixtral_dir, tmp_path):
    """A second family, whose checkpoint names its experts w1/w2/w3 (transformers' modules and PEFT:
    mlp.experts.gate_up_proj / down_proj), in a layout that splits attention and experts; and the
    layout's HF export (the weight push's tensors) is PEFT's merged model."""
    from transformers import AutoModelForCausalLM

    from moe_rl.policy.model import read_hf_config

    sequences = sample_sequences(vocab_size=read_hf_config(mixtral_dir).vocab_size, num=6, max_len=16, seed=4)
    model = peft_model(str(mixtral_dir), RANK, ALPHA, seed=2)
    adapter = peft_adapter(model)
    logp, want = peft_reference(model, sequences)
    results = run_ranks(lora_worker, 4, "tp2-ep2", str(mixtral_dir), sequences, adapter, RANK, ALPHA, timeout=600,
                        export_dir=str(tmp_path / "merged"))
    mx, _ = compare(results, logp)
    assert mx <= 1e-4
    # the HF export (what a weight push sends) is the merged model: W + alpha / r * B A, as PEFT merges it
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).state_dict()
    want_weights = merged_state(model)
    assert set(exported) == set(want_weights)
    worst = max(float((exported[k] - want_weights[k]).abs().max()) for k in exported)
    assert worst <= 1e-6, worst
    grads = {}
    for r in results:
        grads.update(r["grads"])
    assert set(grads) == set(want)
    errors = _grad_errors(grads, want)
    assert max(errors.values()) <= 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_under_other_layouts(tiny_hf_dir, tmp_path):
    """EP2 trains one update with the distributed optimizer and saves; one rank and TP2 load it: the
    adapters come back exactly, and the next update (Adam's moments and step from the checkpoint) gives
    the saving run's adapters; the checkpoint holds no base weight."""
    from moe_rl.testing.lora import lora_checkpoint_worker

    batch = sample_sequences(vocab_size=128, num=8, max_len=12, seed=5)
    ckpt = str(tmp_path / "ckpt")
    saved = run_ranks(lora_checkpoint_worker, 2, "ep2", str(tiny_hf_dir), ckpt, batch, True)
    from megatron.core import dist_checkpointing

    assert dist_checkpointing.load_content_metadata(ckpt)["model_state"] == "lora_adapters"
    want_held, want_next = {}, {}
    for r in saved:
        want_held.update(r["held"])
        want_next.update(r["next"])
    for layout, world in (("single", 1), ("tp2", 2)):
        got = run_ranks(lora_checkpoint_worker, world, layout, str(tiny_hf_dir), ckpt, batch, False)
        held = {k: v for r in got for k, v in r["held"].items()}
        nxt = {k: v for r in got for k, v in r["next"].items()}
        assert set(held) == set(want_held)
        assert all(torch.equal(held[k], want_held[k]) for k in held), layout
        # Adam normalises each step to ~lr (1e-2) per element: moments not restored move elements by ~lr,
        # another layout's sum order by far less (seen: 4e-5 under TP2)
        worst = max(float((nxt[k] - want_next[k]).abs().max()) for k in nxt)
        assert worst <= 1e-3, (layout, worst)
        assert any(float((nxt[k] - held[k]).abs().max()) > 1e-4 for k in nxt)  # the update moved them


def test_check_parity_with_a_peft_adapter(tiny_hf_dir, tmp_path):
    """`moe-rl check-parity --lora`: an adapter PEFT itself saved, read into the megatron policy under
    each layout and compared with HF + PEFT."""
    import json
    import subprocess
    import sys

    model = peft_model(str(tiny_hf_dir), RANK, ALPHA, seed=3)
    model.save_pretrained(str(tmp_path / "adapter"))
    out = tmp_path / "parity.json"
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "check-parity", "--hf-model", str(tiny_hf_dir),
                        "--lora", str(tmp_path / "adapter"), "--layouts", "tp2-ep2,pp2", "--sequences", "4",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [row["layout"] for row in rows] == ["tp2-ep2", "pp2"] and all(row["max_abs_diff"] <= 1e-4 for row in rows)


def test_read_peft_reads_what_peft_saves(tiny_hf_dir, tmp_path):
    from moe_rl.policy.lora import read_peft
    from moe_rl.policy.model import read_hf_config

    model = peft_model(str(tiny_hf_dir), RANK, ALPHA, seed=4)
    model.save_pretrained(str(tmp_path / "adapter"))
    spec, whole = read_peft(str(tmp_path / "adapter"), read_hf_config(tiny_hf_dir))
    want = peft_adapter(model)
    assert (spec.rank, spec.alpha, len(spec.target_modules)) == (RANK, ALPHA, 7)
    assert set(whole) == set(want) and all(torch.equal(whole[k], want[k]) for k in want)
