"""Server-side custom losses (the SDK's `create_custom_loss`): a traced per-datum loss, sent as plain data
(`tinker.types.CustomLossGraph`), rebuilt here from an allow-list of operations and run on live log-probs.

Nothing in a graph is executed as code: every node names a function or a tensor method, which is looked up in
the allowed namespaces (`torch`, `torch.nn.functional`, `torch.special`, `torch.linalg`, `math`, `operator`,
plus `getattr` of public tensor attributes) and refused otherwise, so a client can compute any differentiable
loss of its log-probs and inputs but cannot reach files, processes, the network or the model. The per-datum
losses are summed and metrics reduced by their suffix (`:sum` / `:mean`), as the SDK's client-side runner does;
`TrainingClient.forward_backward_custom` then backpropagates the sum in the same pass.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

# Namespaces a call_function node may name, and names in them a loss may never call (state, I/O, compilation).
_MODULES = ("torch", "torch.nn.functional", "torch.special", "torch.linalg", "math", "operator")
_DENIED = frozenset({"load", "save", "from_file", "compile", "manual_seed", "seed", "set_grad_enabled",
                     "set_default_dtype", "set_default_device", "set_num_threads", "set_printoptions",
                     "use_deterministic_algorithms", "set_rng_state", "get_rng_state", "initial_seed",
                     "enable_grad", "no_grad", "inference_mode", "set_flush_denormal", "empty", "empty_like",
                     "attrgetter", "methodcaller", "call"})
# Tensor methods that leave torch, touch storage or autograd hooks, or move data off the host.
_DENIED_METHODS = frozenset({"item", "numpy", "tolist", "backward", "register_hook", "retain_grad", "storage",
                             "untyped_storage", "data_ptr", "share_memory_", "pin_memory", "cuda", "to_sparse",
                             "set_", "resize_", "requires_grad_", "copy_", "map_", "apply_", "new_empty"})
_ATTRIBUTES = frozenset({"shape", "dtype", "ndim", "T", "mT", "real", "imag"})
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}


class CustomLossError(ValueError):
    """A custom loss graph or its inputs the server refuses; the message names the node, input or datum."""


def _function(target: str, node: str):
    if target in ("getattr", "builtins.getattr"):
        return _safe_getattr
    module_name, _, name = target.rpartition(".")
    if module_name not in _MODULES or not name or name.startswith("_") or name in _DENIED:
        raise CustomLossError(f"node {node}: {target!r} is not an allowed function (custom losses may call "
                              f"functions of {', '.join(_MODULES)})")
    fn = getattr(importlib.import_module(module_name), name, None)
    if not callable(fn) or isinstance(fn, type):  # classes (operator.methodcaller, …) could reach anything
        raise CustomLossError(f"node {node}: {target!r} is not a function")
    return fn


def _safe_getattr(obj, name, *default):
    if not isinstance(name, str) or name not in _ATTRIBUTES:
        raise CustomLossError(f"getattr: attribute {name!r} is not allowed (only {sorted(_ATTRIBUTES)})")
    return getattr(obj, name, *default)


def _decode(value, env: dict[str, Any], node: str):
    if isinstance(value, list):
        return [_decode(v, env, node) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise CustomLossError(f"node {node}: argument {value!r} is not one encoded value")
    (kind, inner), = value.items()
    if kind == "ref":
        if inner not in env:
            raise CustomLossError(f"node {node}: refers to {inner!r} before it is defined")
        return env[inner]
    if kind == "tuple":
        return tuple(_decode(v, env, node) for v in inner)
    if kind == "dict":
        return {str(k): _decode(v, env, node) for k, v in inner.items()}
    if kind == "slice":
        return slice(*(_decode(v, env, node) for v in inner))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float":
        return float(inner)
    if kind == "dtype":
        if inner not in _DTYPES:
            raise CustomLossError(f"node {node}: dtype {inner!r} is not one of {sorted(_DTYPES)}")
        return _DTYPES[inner]
    if kind == "device":
        if inner != "cpu":
            raise CustomLossError(f"node {node}: device {inner!r}: the loss runs where the log-probs are")
        return torch.device("cpu")
    if kind == "layout":
        return getattr(torch, str(inner).removeprefix("torch."))
    if kind == "memory_format":
        return getattr(torch, str(inner).removeprefix("torch."))
    raise CustomLossError(f"node {node}: unknown encoded argument kind {kind!r}")


def _kwargs(node, env: dict[str, Any]) -> dict[str, Any]:
    return {str(k): _decode(v, env, node.name) for k, v in node.kwargs.items()}


@dataclass(frozen=True)
class CustomLoss:
    """A validated custom loss: its name, its inputs (`logprobs` first) with ranks, and its nodes."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    nodes: tuple[Any, ...]

    @property
    def input_names(self) -> tuple[str, ...]:
        """The `loss_fn_inputs` keys the loss reads, in order (after `logprobs`)."""
        return tuple(n for n, _ in self.inputs[1:])

    def per_datum(self, *args: torch.Tensor):
        """Interpret the graph on one datum's tensors -> (scalar loss, metrics)."""
        env: dict[str, Any] = {}
        placeholders = iter(args)
        for node in self.nodes:
            if node.op == "placeholder":
                env[node.name] = next(placeholders)
            elif node.op == "call_function":
                fn = _function(node.target, node.name)
                env[node.name] = fn(*_decode(node.args, env, node.name), **_kwargs(node, env))
            elif node.op == "call_method":
                self_, *rest = _decode(node.args, env, node.name)
                if not isinstance(self_, torch.Tensor):
                    raise CustomLossError(f"node {node.name}: method {node.target!r} called on a "
                                          f"{type(self_).__name__}, not a tensor")
                env[node.name] = getattr(self_, node.target)(*rest, **_kwargs(node, env))
            elif node.op == "output":
                out = _decode(node.args[0], env, node.name)
                if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], dict)):
                    raise CustomLossError(f"loss {self.name!r}: must return (loss, metrics dict)")
                return out[0], out[1]
        raise CustomLossError(f"loss {self.name!r}: the graph has no output node")

    def check_data(self, data) -> None:
        """Every datum has each input the loss reads, at its declared rank (`logprobs`: that of target_tokens)."""
        for i, datum in enumerate(data):
            for (name, rank), key in zip(self.inputs, ("target_tokens", *self.input_names)):
                if key not in datum.loss_fn_inputs:
                    raise CustomLossError(f"datum {i}: no loss_fn_inputs[{key!r}], which loss {self.name!r} takes")
                got = len(datum.loss_fn_inputs[key].shape or [0])
                if got != rank:
                    raise CustomLossError(f"datum {i}: loss_fn_inputs[{key!r}] has rank {got}, but loss "
                                          f"{self.name!r} declared {name} with rank {rank}")

    def __call__(self, data, logprobs_list: list[torch.Tensor]):
        """`forward_backward_custom`'s loss_fn: the per-datum losses summed, metrics reduced by suffix."""
        total, sums = None, {}
        for i, (datum, logprobs) in enumerate(zip(data, logprobs_list, strict=True)):
            inputs = [datum.loss_fn_inputs[k].to_torch() for k in self.input_names]
            loss, metrics = self.per_datum(logprobs, *inputs)
            if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
                raise CustomLossError(f"datum {i}: loss {self.name!r} must return a scalar tensor, got "
                                      f"{getattr(loss, 'shape', type(loss).__name__)}")
            total = loss if total is None else total + loss
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value.detach() if isinstance(value, torch.Tensor) else value)
        return total, {k: v / len(data) if k.endswith(":mean") else v for k, v in sums.items()}


def build_custom_loss(name: str, inputs, graph) -> CustomLoss:
    """A `CustomLoss` from the SDK's `CreateCustomLossRequest` fields, every node checked before anything runs."""
    inputs = tuple((str(i.name), int(i.rank)) for i in inputs)
    if not inputs or inputs[0][0] != "logprobs" or inputs[0][1] not in (1, 2):
        raise CustomLossError("inputs: the first input must be logprobs with rank 1 or 2")
    nodes = tuple(graph.nodes)
    placeholders = [n.target for n in nodes if n.op == "placeholder"]
    if placeholders != [n for n, _ in inputs]:
        raise CustomLossError(f"graph: placeholders {placeholders} do not match inputs {[n for n, _ in inputs]}")
    names: set[str] = set()
    for node in nodes:
        if node.name in names:
            raise CustomLossError(f"graph: node name {node.name!r} is used twice")
        names.add(node.name)
        if node.op == "call_function":
            if _function(node.target, node.name) is _safe_getattr and (
                    len(node.args) < 2 or node.args[1] not in _ATTRIBUTES):
                raise CustomLossError(f"node {node.name}: getattr of {node.args[1:2]!r} is not allowed (only "
                                      f"{sorted(_ATTRIBUTES)})")
        elif node.op == "call_method":
            if (node.target.startswith("_") or node.target in _DENIED_METHODS
                    or not callable(getattr(torch.Tensor, node.target, None))):
                raise CustomLossError(f"node {node.name}: tensor method {node.target!r} is not allowed")
        elif node.op not in ("placeholder", "output"):
            raise CustomLossError(f"node {node.name}: op {node.op!r} is not allowed (no modules, no captured "
                                  f"tensors)")
    if not nodes or nodes[-1].op != "output":
        raise CustomLossError("graph: the last node must be the output")
    return CustomLoss(name, inputs, nodes)


