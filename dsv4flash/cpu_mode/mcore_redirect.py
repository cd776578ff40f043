"""CPU development mode for megatron-core 0.19.x: redirect its CUDA-only calls to the CPU.

megatron-core places buffers on `torch.cuda.current_device()`, seeds and forks the CUDA RNG, creates
CUDA streams/events, sometimes passes `device="cuda"` literally and converts split sizes to numpy only for
CUDA tensors, and its optimizers accept only parameters whose `type()` names CUDA. Its optimizer CPU
offload (`HybridDeviceOptimizer`) offloads only parameters that report `is_cuda` and pins its host copies. Without TE or Apex (always, on a CPU) its distributed optimizer falls
back to torch's Adam, whose per-parameter `step` state its resharding load does not expect. `install()`
points all of that at the CPU (the offload keeps real, separate host copies of the "device" parameters, so
host and device state stay distinct tensors) and completes the torch-Adam checkpoint load; `uninstall()`
restores every attribute it replaced.
It changes global torch state, so nothing installs it implicitly except veRL's CPU development platform
(`VERL_PLATFORM=cpu`, `dsv4flash.integrations.verl.cpu_platform`), in its own worker processes and only
where no CUDA device is visible (checked there); the tests use it through `tests.mcore_cpu.shim` (the same
module state).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from typing import Any, Callable, Iterator

import torch
from torch.utils._device import _device_constructors

_CPU = torch.device("cpu")
_FACTORIES = (
    "zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint", "as_tensor",
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
)
# Megatron logs this whenever a "CUDA" RNG fork touches the CPU stream, which is the point of the redirect.
_RNG_WARNING = "CPU RNG state changed within GPU RNG context"

_saved: list[tuple[Any, str, Any]] = []


class _NullStream:
    """Stands in for `torch.cuda.Stream` and `torch.cuda.Event`: every synchronisation is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = _CPU

    def __getattr__(self, name: str) -> Callable[..., None]:
        # wait_stream, wait_event, synchronize, record, record_event, query, current_stream_wait, ...
        return lambda *args, **kwargs: None

    def query(self) -> bool:
        """An idle stream has always finished its work."""
        return True

    def record_event(self, event: Any = None) -> "_NullStream":
        """Callers synchronise on the returned event later, so hand back a real (inert) object."""
        return event if event is not None else _NullStream()


class _DropRngWarning(logging.Filter):
    """Drops Megatron's 'CPU RNG changed' warning, expected once CUDA RNG forks act on the CPU RNG."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep every record except the one expected warning."""
        return _RNG_WARNING not in record.getMessage()


def _to_cpu(device: Any) -> Any:
    """Map any CUDA device spec (str, int index, torch.device) to the CPU; leave others alone."""
    if isinstance(device, torch.device):
        return _CPU if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    return device


def _redirect_factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap a tensor factory so an explicit `device="cuda..."` lands on the CPU."""

    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if kwargs.get("pin_memory") and not torch.cuda.is_available():
            kwargs["pin_memory"] = False  # no pinned allocator without an accelerator; host memory is host memory
        return fn(*args, **kwargs)

    factory.__wrapped_by_mcore_cpu_shim__ = fn  # type: ignore[attr-defined]
    return factory


def _replace(owner: Any, name: str, value: Any) -> None:
    """Set `owner.name = value`, remembering the original for `uninstall()`."""
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _cpu_rng_get(*args: Any, **kwargs: Any) -> torch.Tensor:
    """CUDA RNG state getters return the CPU RNG state."""
    return torch.get_rng_state()


def _cpu_rng_set(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """CUDA RNG state setters set the CPU RNG state."""
    torch.set_rng_state(new_state)


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """`moe_utils.maybe_move_tensor_to_cpu` for CPU tensors: numpy when asked, as the GPU path returns.

    Stock code converts only CUDA tensors, so on CPU the alltoall dispatcher's split sizes stay tensors and
    gloo's `all_to_all_single` rejects them once expert parallelism is > 1.
    """
    if as_numpy and torch.is_tensor(tensor):
        return tensor.detach().numpy()
    return tensor


def _pin_memory(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`Tensor.pin_memory` without an accelerator: the host tensor itself (pinning only matters for DMA)."""

    @functools.wraps(original)
    def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self if not torch.cuda.is_available() and self.device.type == "cpu" else original(self, *args, **kwargs)

    return pin_memory


@contextlib.contextmanager
def _reporting_cuda(tensors: set[int]) -> Iterator[None]:
    """Inside the block, the tensors whose `id` is in `tensors` report `is_cuda` (the rest their real device)."""
    real = torch._C.TensorBase.is_cuda
    torch.Tensor.is_cuda = property(lambda self: id(self) in tensors or real.__get__(self))
    try:
        yield
    finally:
        del torch.Tensor.is_cuda


def _offload_split_on_cpu(original: Callable[..., Any]) -> Callable[..., Any]:
    """`HybridDeviceOptimizer._get_sub_optimizer_param_groups` with the model's parameters as the device ones.

    Upstream offloads (clones to the host) only parameters that report `is_cuda`; on the CPU none does, so
    nothing got a host copy and the first step failed (`KeyError` in `_set_sub_optimizer_grads`). Here the
    parameters handed to the optimizer are the "device" ones, so `offload_fraction` of them get separate
    host copies (master weights and moments live there, results are copied back) exactly as on a GPU.
    """

    @functools.wraps(original)
    def split(self: Any, offload_fraction: float) -> Any:
        device_params = {id(p) for group in self.param_groups for p in group["params"]}
        with _reporting_cuda(device_params):
            return original(self, offload_fraction)

    return split


def _loading_initialises_torch_adam(original: Callable[..., Any]) -> Callable[..., Any]:
    """`DistributedOptimizer.sharded_state_dict`: with torch's Adam, initialise the state before a load.

    Its `state_dict()` reads each parameter's `step`, which torch's Adam creates on its first step, so a
    fresh optimizer could not even describe what it wants to load (`assert len(steps) == 1`). Upstream does
    the same dummy initialisation for its `fully_sharded_model_space` format; the loaded values replace it.
    """

    @functools.wraps(original)
    def sharded_state_dict(self: Any, model_sharded_state_dict: Any, is_loading: bool = False, *args: Any,
                           **kwargs: Any) -> Any:
        from megatron.core.optimizer import distrib_optimizer

        if is_loading and not distrib_optimizer.HAVE_APEX_OR_TE and len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()
        return original(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    return sharded_state_dict


def _states_keep_torch_adam_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """`DistributedOptimizer._set_main_param_and_optimizer_states` that leaves state the checkpoint lacks.

    A resharding load (`fully_reshardable`, `dp_reshardable`) hands over the main param and the moments;
    torch's Adam also holds a per-parameter `step` tensor, which `load_state_dict` restores from the param
    groups, and the stock setter indexed the loaded tensors by it (`KeyError: 'step'`). In fp32 (no separate
    master copy) the main param is a view of the model's own leaf parameter, so the stock in-place copy
    raises "a view of a leaf Variable that requires grad is being used in an in-place operation" (a veRL
    fp32 run resumed from its checkpoint): the copy is a load, made under `torch.no_grad()`.
    """

    @functools.wraps(original)
    def set_states(self: Any, model_param: Any, tensors: dict) -> Any:
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            kept = {k: v for k, v in self.optimizer.state[main_param].items() if k not in tensors}
            tensors = {**kept, **tensors}  # a kept tensor is copied onto itself
        with torch.no_grad():
            return original(self, model_param, tensors)

    return set_states


def _load_gives_each_param_its_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """`DistributedOptimizer.load_state_dict` with torch's Adam: one `step` tensor per parameter.

    The stock load puts the *same* step tensor into every parameter's state, and torch's Adam increments
    each parameter's step in place, so after one resumed step parameter i had seen i + 1 increments (wrong
    bias correction everywhere but the first parameter; found by the CP = 2 -> PP = 2 resume test).
    """

    @functools.wraps(original)
    def load_state_dict(self: Any, state_dict: Any) -> Any:
        from megatron.core.optimizer import distrib_optimizer

        out = original(self, state_dict)
        if not distrib_optimizer.HAVE_APEX_OR_TE:
            for state in self.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        return out

    return load_state_dict


def _megatron_type_name(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Tensor.type()` that reports a host tensor under its CUDA name when megatron-core's optimizer asks.

    Its mixed-precision and distributed optimizers dispatch on `param.type() == 'torch.cuda.FloatTensor'`
    (or Half/BFloat16) and refuse anything else; only calls made from `megatron.core.optimizer` see the
    CUDA name, so no other caller can mistake a host tensor for a CUDA one.
    """

    @functools.wraps(original)
    def type_(self, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or ".cuda." in name:
            return name
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return name.replace("torch.", "torch.cuda.", 1) if caller.startswith("megatron.core.optimizer") else name

    return type_


def installed() -> bool:
    """Whether the redirect is active in this process."""
    return bool(_saved)


def install() -> None:
    """Redirect CUDA-only calls to the CPU (idempotent). Imports megatron.core.tensor_parallel itself."""
    if _saved:
        return
    from megatron.core.tensor_parallel import random as mcore_random  # must exist before we patch it

    # `with torch.device(...)` applies to the functions in this cached set; built while the factories below are
    # wrapped it would hold the wrappers, and meta/device contexts would stop working for the originals (and,
    # during the redirect, for the wrappers too), so it is built from the originals first.
    _device_constructors()
    cuda = torch.cuda
    _replace(cuda, "current_device", lambda: _CPU)
    for owner in (cuda, cuda.random):
        _replace(owner, "get_rng_state", _cpu_rng_get)
        _replace(owner, "set_rng_state", _cpu_rng_set)
        # Seeding the "CUDA" generator must not reseed the CPU stream that now stands in for it.
        _replace(owner, "manual_seed", lambda seed: None)
        _replace(owner, "manual_seed_all", lambda seed: None)
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for owner in (moe_utils, token_dispatcher):
        _replace(owner, "maybe_move_tensor_to_cpu", _host_copy)
    _replace(mcore_random, "_get_cuda_rng_state", _cpu_rng_get)
    _replace(mcore_random, "_set_cuda_rng_state", _cpu_rng_set)
    _replace(cuda, "Stream", _NullStream)
    _replace(cuda, "Event", _NullStream)
    _replace(cuda, "current_stream", lambda *args, **kwargs: _NullStream())
    _replace(cuda, "default_stream", lambda *args, **kwargs: _NullStream())
    _replace(cuda, "stream", lambda *args, **kwargs: contextlib.nullcontext())
    _replace(cuda, "synchronize", lambda *args, **kwargs: None)
    _replace(torch.Tensor, "record_stream", lambda self, *args, **kwargs: None)
    _replace(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    _replace(torch.Tensor, "pin_memory", _pin_memory(torch.Tensor.pin_memory))
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    _replace(HybridDeviceOptimizer, "_get_sub_optimizer_param_groups",
             _offload_split_on_cpu(HybridDeviceOptimizer._get_sub_optimizer_param_groups))
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    _replace(DistributedOptimizer, "sharded_state_dict",
             _loading_initialises_torch_adam(DistributedOptimizer.sharded_state_dict))
    _replace(DistributedOptimizer, "_set_main_param_and_optimizer_states",
             _states_keep_torch_adam_step(DistributedOptimizer._set_main_param_and_optimizer_states))
    _replace(DistributedOptimizer, "load_state_dict",
             _load_gives_each_param_its_step(DistributedOptimizer.load_state_dict))
    _replace(torch.Tensor, "type", _megatron_type_name(torch.Tensor.type))
    for name in _FACTORIES:
        _replace(torch, name, _redirect_factory(getattr(torch, name)))
    rng_filter = _DropRngWarning()
    rng_logger = logging.getLogger(mcore_random.__name__)
    rng_logger.addFilter(rng_filter)
    _saved.append((rng_logger, "__filter__", rng_filter))


def uninstall() -> None:
    """Restore everything `install()` replaced, newest first."""
    while _saved:
        owner, name, original = _saved.pop()
        if name == "__filter__":
            owner.removeFilter(original)
        else:
            setattr(owner, name, original)
    _device_constructors.cache_clear()  # in case something built it from the wrappers meanwhile


@contextlib.contextmanager
def cuda_redirect() -> Iterator[None]:
    """Context manager form: install for the block, restore afterwards if this call installed it."""
    owner = not installed()
    install()
    try:
        yield
    finally:
        if owner:
            uninstall()
