"""Device guard: on CPU, fail where a GPU run would, when moe_rl hands a host tensor to a collective.

A GPU run's process groups are NCCL, which has no CPU backend: `dist.all_reduce` of a
host tensor fails there, and nowhere else. On a CPU machine the compute device *is*
the CPU, so a host tensor and a device tensor look the same and gloo takes both. The
guard makes them differ again:

- `moe_rl.dist.devices.compute_device()` returns a simulated accelerator, `cuda:0`, which
  `moe_rl.policy.compat` maps to the CPU in every tensor op (the maths is unchanged);
  so does `torch.cuda.current_device()`, where megatron allocates its buffers.
- A `TorchFunctionMode`, pushed on top of compat's so it sees the device arguments
  before compat rewrites them, tracks which storages live on that device: results of
  factories given a cuda device, of `.cuda()` / `.to(<cuda>)`, and of any op with a
  device input (a GPU computes those on the GPU). `.cpu()` / `.to("cpu")` give host
  tensors. Views and in-place results keep their input's placement. A move that compat
  answers with the tensor itself (it is already on the CPU) returns a copy instead, as
  a real move would, so the host original stays a host tensor.
- torch.distributed's tensor collectives are wrapped: a call made from moe_rl code whose
  tensor is not on the device raises `HostTensorInCollective`, naming the function, the
  caller and the tensor.

Not checked: calls made outside moe_rl (megatron's own collectives: their buffers come
from `torch.cuda.current_device()`, which megatron gets right on a GPU, and which the
guard maps to the simulated device anyway), moe_rl.testing's harness code, and object
collectives (`broadcast_object_list`, `all_gather_object`: torch moves their payload to
the right device itself).

Known limit: `t.device` still reports `cpu` for a tensor on the simulated device, so
code that sends a result "back to the caller's device" sends it to the host; that can
only make the guard stricter than a GPU, never let a host tensor through.

Marks are kept per storage (views, `Parameter` wrappers and `.data` share it), through
weak references, so freed storages leave no stale marks.

Use `with device_guard():` in tests, or `install_device_guard()` once at the start of a
trainer process, before the policy is built (the CPU rehearsal's `train.device_guard`):
tensors made before it count as host tensors. The policy's parameters count as device
tensors only where moe_rl puts them on `compute_device()` (on CPU megatron initialises
them on the host), as a GPU run must for NCCL to gather them.

Modes are per thread: the guard tracks tensors of the thread that installed it.
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from moe_rl.dist import devices

# The tensor collectives of torch.distributed (point-to-point included). Object
# collectives are left out on purpose (see the module docstring).
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
               "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all",
               "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv")

# Set while a guarded collective runs in this thread (see `_wrap`).
_calls = threading.local()

# Sweep expired storage references after this many new marks (bounds the table's size).
_SWEEP_EVERY = 4096


class HostTensorInCollective(RuntimeError):
    """A collective called from moe_rl got a tensor that is not on the compute device."""


class DeviceGuardError(RuntimeError):
    """The device guard cannot run here (a GPU machine, or compat cannot be activated)."""


def _is_cuda(device: Any) -> bool:
    from moe_rl.policy.compat import is_cuda_device

    return is_cuda_device(device)


class _DeviceTracker(TorchFunctionMode):
    """Marks the storages that a GPU run would hold on the device (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._on_device: dict[int, StorageWeakRef] = {}
        self._since_sweep = 0

    # ------------------------------------------------------------ marks
    def is_marked(self, t: torch.Tensor) -> bool:
        """Whether `t`'s storage lives on the (simulated) compute device."""
        with torch._C.DisableTorchFunction():
            key = _storage_key(t)
        ref = self._on_device.get(key) if key is not None else None
        return ref is not None and not ref.expired()

    def mark(self, t: torch.Tensor) -> None:
        with torch._C.DisableTorchFunction():
            try:
                ref = StorageWeakRef(t.untyped_storage())
            except (RuntimeError, NotImplementedError):  # no storage (e.g. a sparse tensor): not tracked
                return
        self._on_device[ref.cdata] = ref
        self._since_sweep += 1
        if self._since_sweep >= _SWEEP_EVERY:
            self._on_device = {k: r for k, r in self._on_device.items() if not r.expired()}
            self._since_sweep = 0

    # ------------------------------------------------------------ the mode
    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch._C._nn._parse_to:
            # nn.Module.to parses its arguments first and moves each tensor with the parsed
            # device: keep it cuda (compat would map it to the CPU here) so the moves are seen.
            with torch._C.DisableTorchFunction():
                return func(*args, **kwargs)
        target = _placement(func, args, kwargs, self.is_marked)
        result = func(*args, **kwargs)  # compat, below this mode, maps cuda devices to the CPU
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if target is not None and inputs and result is inputs[0] and self.is_marked(result) != target:
            # A device move that compat answered with the tensor itself: on a GPU it is a copy.
            with torch._C.DisableTorchFunction():
                result = result.clone()
        on_device = target if target is not None else any(self.is_marked(t) for t in inputs)
        if not on_device:
            return result
        with torch._C.DisableTorchFunction():
            own = {_storage_key(t) for t in inputs}
        for out in tree_flatten(result)[0]:
            # Views and in-place results share an input's storage and keep its placement.
            if isinstance(out, torch.Tensor) and _storage_key_plain(out) not in own:
                self.mark(out)
        return result


def _storage_key(t: torch.Tensor) -> int | None:
    """The id of `t`'s storage (call with torch functions disabled); None without storage."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _storage_key_plain(t: torch.Tensor) -> int | None:
    with torch._C.DisableTorchFunction():
        return _storage_key(t)


def _placement(func: Callable, args: tuple, kwargs: dict, is_marked: Callable[[torch.Tensor], bool]) -> bool | None:
    """Where `func` puts its result: True device, False host, None as its inputs (no device named)."""
    if func is torch.Tensor.cuda:
        return True
    if func is torch.Tensor.cpu:
        return False
    if kwargs.get("device") is not None:
        return _is_cuda(kwargs["device"])
    if func is torch.Tensor.to:
        for a in args[1:]:
            if isinstance(a, torch.Tensor):  # .to(other): other's device
                return is_marked(a)
            if isinstance(a, (str, torch.device)) or (isinstance(a, int) and not isinstance(a, bool)):
                return _is_cuda(a)
    return None


# ---------------------------------------------------------------- collectives
def _caller() -> tuple[str, str]:
    """The module calling the collective, and where (file:line)."""
    frame = sys._getframe(2)  # 0: here, 1: the wrapper, 2: the caller
    name = frame.f_globals.get("__name__", "")
    return name, f"{frame.f_code.co_filename}:{frame.f_lineno} ({name})"


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _tensor_args(bound: inspect.BoundArguments) -> Iterator[tuple[str, torch.Tensor]]:
    """(argument name, tensor) for every tensor a collective was given, lists and P2POps included."""
    for name, value in bound.arguments.items():
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if isinstance(v, torch.Tensor):
                    yield f"{name}[{i}]", v
                elif isinstance(v, dist.P2POp):
                    yield f"{name}[{i}].tensor", v.tensor


def _wrap(fn: Callable, guard: "DeviceGuard") -> Callable:
    sig = inspect.signature(fn)
    qualname = f"torch.distributed.{fn.__name__}"

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        # torch's collectives re-dispatch themselves through the torch function modes (and
        # batch_isend_irecv / object collectives call other collectives): only the outermost
        # call is the caller's; the nested ones come from torch and compat.
        if getattr(_calls, "inside", False):
            return fn(*args, **kwargs)
        module, where = _caller()
        if _under(module, guard.checked) and not _under(module, guard.exempt):
            guard.calls[f"{fn.__name__} from {module}"] += 1
            bound = sig.bind(*args, **kwargs)
            for name, t in _tensor_args(bound):
                if not guard.is_on_device(t):
                    raise HostTensorInCollective(
                        f"{qualname} called at {where} with a host tensor as `{name}` (shape "
                        f"{list(t.shape)}, dtype {t.dtype}): under NCCL this fails on a GPU: move it to "
                        f"moe_rl.dist.devices.compute_device()")
        _calls.inside = True
        try:
            return fn(*args, **kwargs)
        finally:
            _calls.inside = False

    return guarded


# ---------------------------------------------------------------- the guard
class DeviceGuard:
    """The installed pieces: the tracking mode, the wrapped collectives, the simulated device."""

    def __init__(self, checked: tuple[str, ...] = ("moe_rl",), exempt: tuple[str, ...] = ("moe_rl.testing",)) -> None:
        self.checked, self.exempt = tuple(checked), tuple(exempt)
        self.tracker = _DeviceTracker()
        self._saved: list[tuple[Any, str, Any]] = []
        # "<collective> from <module>" -> calls checked (and passed or failed)
        self.calls: Counter[str] = Counter()

    def is_on_device(self, t: torch.Tensor) -> bool:
        """Whether the guard counts `t` as living on the compute device."""
        return self.tracker.is_marked(t)

    def __enter__(self) -> "DeviceGuard":
        if torch.cuda.is_available():
            raise DeviceGuardError("the device guard is for CPU machines: on a GPU, NCCL itself refuses host "
                                   "tensors in collectives; turn train.device_guard off")
        from moe_rl.policy import compat

        if not compat.activate():
            raise DeviceGuardError("the device guard needs moe_rl.policy.compat active (it maps the simulated "
                                   "cuda device to the CPU), and compat could not be activated")
        # Both namespaces: P2POp and batch_isend_irecv compare ops with distributed_c10d's own
        # isend / irecv, so the wrapped functions must be those too.
        from torch.distributed import distributed_c10d

        for name in COLLECTIVES:
            original = getattr(distributed_c10d, name)
            wrapped = _wrap(original, self)
            for module in (dist, distributed_c10d):
                if getattr(module, name, None) is original:
                    self._saved.append((module, name, original))
                    setattr(module, name, wrapped)
        self._saved.append((torch.cuda, "current_device", torch.cuda.current_device))
        torch.cuda.current_device = lambda: devices.SIMULATED_DEVICE  # megatron's allocations
        devices.simulate_accelerator(True)
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tracker.__exit__(*exc)
        devices.simulate_accelerator(False)
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()


_ACTIVE: DeviceGuard | None = None


def active_guard() -> DeviceGuard | None:
    """The guard in force in this process, if any."""
    return _ACTIVE


@contextmanager
def device_guard(checked: tuple[str, ...] = ("moe_rl",),
                 exempt: tuple[str, ...] = ("moe_rl.testing",)) -> Iterator[DeviceGuard]:
    """Run the block under the device guard; everything is undone on exit.

    checked: module prefixes whose collective calls are checked; exempt: prefixes left
    out. Inside a guard already in force (e.g. installed), yields that one unchanged.
    Raises DeviceGuardError on a machine with CUDA.
    """
    global _ACTIVE
    if _ACTIVE is not None:
        yield _ACTIVE
        return
    guard = DeviceGuard(checked, exempt)
    guard.__enter__()
    _ACTIVE = guard
    try:
        yield guard
    finally:
        _ACTIVE = None
        guard.__exit__(None, None, None)


def install_device_guard() -> DeviceGuard:
    """Put the device guard in force for the rest of this process (idempotent).

    Call it first thing in a trainer process, before the policy is built, in the thread
    that trains (torch function modes are per thread). Raises DeviceGuardError on a
    machine with CUDA.
    """
    global _ACTIVE
    if _ACTIVE is None:
        guard = DeviceGuard()
        guard.__enter__()
        _ACTIVE = guard
    return _ACTIVE
