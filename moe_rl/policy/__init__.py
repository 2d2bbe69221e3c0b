"""The policy in megatron-core: the only package in moe_rl that imports megatron."""
import warnings

# megatron-core announces at import time that it falls back to torch kernels when
# apex / transformer-engine are missing (always true on CPU); say it once in the docs,
# not on every process start.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated.*")
warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*deprecated.*")
warnings.filterwarnings("ignore", message=".*sequence_parallel. is set to .True., but tensor model parallel size is 1.*")
