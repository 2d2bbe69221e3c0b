"""GPU performance settings of the policy: megatron's fused kernels and DDP's communication overlap.

Each setting is requested as true, false or None (auto) in the config (`model.*_fusion`,
`parallel.overlap_*`) and resolved here, once, against what this process has: a GPU,
transformer-engine (and its version), NVIDIA apex's `fused_weight_gradient_mlp_cuda`. Auto is on
where megatron-core 0.16.1 can run the setting and off on CPU, where the plain paths are exact and
the fused kernels do not exist. An explicit true whose requirement is missing is refused with the
field and the requirement, never silently dropped. What each needs (megatron-core 0.16.1):

  moe_permute_fusion            TE >= 2.1 (moe_utils.fused_permute & co.; transformer_config.py)
  apply_rope_fusion             TE >= 1.4 (rope_utils.fused_apply_rotary_pos_emb)
  bias_activation_fusion        megatron's own fused SwiGLU (fusions/fused_bias_swiglu.py)
  bias_dropout_fusion           megatron's own fused bias-dropout-add
  gradient_accumulation_fusion  apex's fused_weight_gradient_mlp_cuda (tensor_parallel/layers.py asks for
                                it in every ColumnParallelLinear, the output layer's too, TE spec or not)
  overlap_grad_reduce           nothing: DDP reduces each bucket as its gradients are ready
  overlap_param_gather          the distributed optimizer (the gather of updated parameters moves into
                                the next forward's pre-hooks)
  moe_router_fusion             TE; it skips RouterReplay, so the config allows it only without replay
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import asdict, dataclass

import torch

FUSIONS = ("moe_permute_fusion", "apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion",
           "gradient_accumulation_fusion")
OVERLAPS = ("overlap_grad_reduce", "overlap_param_gather")


@dataclass(frozen=True)
class PerfRequest:
    """The config's requests: True / False, or None = auto."""

    moe_permute_fusion: bool | None = None
    apply_rope_fusion: bool | None = None
    bias_activation_fusion: bool | None = None
    bias_dropout_fusion: bool | None = None
    gradient_accumulation_fusion: bool | None = None
    moe_router_fusion: bool = False
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None


@dataclass(frozen=True)
class Machine:
    """What this process can run: a GPU, transformer-engine's version (None: not installed), apex's
    fused weight-gradient kernel."""

    gpu: bool
    te_version: tuple[int, int] | None
    apex_wgrad: bool

    @classmethod
    def here(cls) -> "Machine":
        te = None
        if importlib.util.find_spec("transformer_engine") is not None:
            try:
                te = tuple(int(x) for x in importlib.metadata.version("transformer_engine").split(".")[:2])
            except (importlib.metadata.PackageNotFoundError, ValueError):
                te = (0, 0)
        return cls(gpu=torch.cuda.is_available(), te_version=te,
                   apex_wgrad=importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None)


def _te(at_least: tuple[int, int]):
    def need(m: Machine) -> str | None:
        if m.gpu and m.te_version is not None and m.te_version >= at_least:
            return None
        have = "no GPU" if not m.gpu else ("transformer-engine is not installed" if m.te_version is None
                                           else f"transformer-engine {'.'.join(map(str, m.te_version))}")
        return f"a GPU with transformer-engine >= {'.'.join(map(str, at_least))} ({have})"
    return need


def _gpu(m: Machine) -> str | None:
    return None if m.gpu else "a GPU (this process has none)"


def _apex(m: Machine) -> str | None:
    if m.gpu and m.apex_wgrad:
        return None
    return "a GPU and NVIDIA apex built with --cuda_ext (fused_weight_gradient_mlp_cuda)" + \
        ("" if m.gpu else " (this process has no GPU)")


# setting -> what it needs (None when this machine has it); overlap_param_gather's extra rule is below.
_NEEDS = {"moe_permute_fusion": _te((2, 1)), "apply_rope_fusion": _te((1, 4)),
          "bias_activation_fusion": lambda m: None, "bias_dropout_fusion": lambda m: None,
          "gradient_accumulation_fusion": _apex, "overlap_grad_reduce": lambda m: None,
          "overlap_param_gather": lambda m: None}
# Auto turns a setting on only with a GPU (off on CPU: the plain paths are exact there).
_SECTION = {**{k: "model" for k in FUSIONS}, **{k: "parallel" for k in OVERLAPS}}


@dataclass(frozen=True)
class PerfSettings:
    """The resolved settings: what megatron's TransformerConfig and DDP get."""

    moe_permute_fusion: bool = False
    apply_rope_fusion: bool = False
    bias_activation_fusion: bool = False
    bias_dropout_fusion: bool = False
    gradient_accumulation_fusion: bool = False
    moe_router_fusion: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False

    def transformer_kwargs(self) -> dict[str, bool]:
        """Fields of megatron's TransformerConfig."""
        return {k: v for k, v in asdict(self).items() if k not in OVERLAPS}


def resolve(req: PerfRequest, *, distributed_optimizer: bool, moe: bool = True,
            machine: Machine | None = None) -> PerfSettings:
    """Each request resolved against `machine` (default: this process's). Raises ValueError naming the
    field when an explicit true cannot run here."""
    m = Machine.here() if machine is None else machine
    out: dict[str, bool] = {}
    for name in (*FUSIONS, *OVERLAPS):
        wanted = getattr(req, name)
        missing = _NEEDS[name](m)
        if name == "overlap_param_gather" and not distributed_optimizer:
            missing = "train.distributed_optimizer=true (the distributed optimizer gathers the parameters)"
        if name == "moe_permute_fusion" and not moe:
            missing = missing or "a model with routed experts"
        if wanted is None:
            out[name] = m.gpu and missing is None
        elif wanted and missing is not None:
            raise ValueError(f"{_SECTION[name]}.{name}=true needs {missing}; set it to false, or null (auto)")
        else:
            out[name] = bool(wanted)
    if out["overlap_param_gather"] and not out["overlap_grad_reduce"]:
        if req.overlap_param_gather:
            raise ValueError("parallel.overlap_param_gather=true needs parallel.overlap_grad_reduce (megatron "
                             "overlaps the parameter gather only together with the gradient reduction)")
        out["overlap_param_gather"] = False
    if req.moe_router_fusion:
        missing = _te((2, 7))(m)
        if missing:
            raise ValueError(f"model.moe_router_fusion=true needs {missing}; set it to false")
    return PerfSettings(**out, moe_router_fusion=bool(req.moe_router_fusion) and moe)


def use_transformer_engine() -> bool:
    """TE spec only on GPU and only when transformer-engine imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True
