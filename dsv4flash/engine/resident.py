"""The resident base: one copy of the base weights, shared by every LoRA placement and every policy.

A placement (one per distinct `LoraConfig`) is a model shell whose base parameters and buffers are the
resident tensors themselves (same storage), with LoRA wrappers applied. A policy owns only its adapter
Parameters; `bind` plugs them into the shell for the duration of a call (no copy), so gradients land on
the policy's own tensors and its optimizer never sees another policy's state. `lock` serialises compute:
whatever a policy does outside it (reward computation, environment waits) leaves the base to the others.
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from dsv4flash.config import load_config
from dsv4flash.lora import LoraConfig as PlacementConfig
from dsv4flash.lora import apply_lora, lora_parameters
from dsv4flash.lora.state import canonical_key


def placement_key(placement: PlacementConfig) -> str:
    """The identity of a placement: one shell (and one adapter layout) per distinct key."""
    return json.dumps(placement.to_dict(), sort_keys=True, default=str)


def _stop_between_layers(model: nn.Module) -> None:
    """Check the running call's cancel flag and deadline before each layer, so a large forward stops mid-way."""
    from dsv4flash.service import calls

    for layer in model.layers:
        layer.register_forward_pre_hook(lambda _module, _args: calls.check())


class ResidentBase:
    """Base weights held once (`base_model`: a config name/path; `base_dir`: a local-engine base checkpoint).

    `device`/`dtype` (default auto: CUDA and the release's bfloat16 when torch sees a device, else the CPU in
    float32; dsv4flash/engine/device.py) say where the base computes; adapters live beside it. Callers hand in
    and get back CPU tensors (`forward`, the service's compute functions), so only the model's calls cross."""

    def __init__(self, base_model: str = "tiny", *, base_dir: str | Path | None = None, seed: int = 0,
                 device: str = "auto", dtype: str = "auto") -> None:
        from dsv4flash.engine.device import resolve_compute
        from dsv4flash.model.transformer import Transformer

        self.base_model = base_model
        self.cfg = load_config(base_model)
        self.compute = resolve_compute(device, dtype, release_dtype=self.cfg.dtype)
        self.device = self.compute.device
        # Built and loaded on the CPU (the same bits on every device), then moved.
        self.model = Transformer(self.cfg, self.compute.dtype, "cpu", seed=seed).eval().requires_grad_(False)
        _stop_between_layers(self.model)
        if base_dir is not None:
            from dsv4flash.engine import model_io

            model_io.load_base_weights(self.model, base_dir)
        if self.device.type != "cpu":
            self.model.to(self.device)
        self.lock = threading.RLock()
        self._shells: dict[str, nn.Module] = {}
        self._slots: dict[str, dict[str, tuple[nn.Module, str]]] = {}

    def base_bytes(self) -> int:
        """Bytes of the resident base parameters (held once however many policies run)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def shell(self, placement: PlacementConfig) -> nn.Module:
        """The LoRA-wrapped model for `placement`, sharing every base tensor with the resident model."""
        key = placement_key(placement)
        with self.lock:
            if key not in self._shells:
                shell = self._share_base()
                apply_lora(shell, placement)
                shell.eval()
                _stop_between_layers(shell)
                self._shells[key] = shell
                self._slots[key] = {canonical_key(n): (shell.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2])
                                    for n, _ in shell.named_parameters() if n.endswith((".lora_A", ".lora_B"))}
            return self._shells[key]

    def fresh_adapter(self, placement: PlacementConfig) -> dict[str, nn.Parameter]:
        """New adapter Parameters for `placement` (A initialised from `placement.seed`, B = 0), owned by the caller."""
        shell = self.shell(placement)
        with self.lock:
            gen = torch.Generator().manual_seed(placement.seed)
            out = {}
            for key, p in lora_parameters(shell).items():
                if key.endswith("lora_B.weight"):
                    out[key] = nn.Parameter(torch.zeros_like(p))
                else:  # Kaiming-uniform-like init, deterministic per placement seed (drawn on the CPU: same bits)
                    fan_in = p.shape[-1]
                    bound = (1.0 / fan_in) ** 0.5
                    init = torch.empty_like(p, device="cpu").uniform_(-bound, bound, generator=gen)
                    out[key] = nn.Parameter(init if self.device.type == "cpu" else init.to(self.device))
            return out

    def to_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` (an adapter read from the store) where the base computes (the same dict on the CPU)."""
        if self.device.type == "cpu":
            return tensors
        return {k: v.to(self.device) for k, v in tensors.items()}

    def adapter_slots(self, placement: PlacementConfig) -> dict[str, tuple[nn.Module, str]]:
        """Canonical adapter key -> (module, factor name) in `placement`'s shell (where `bind` plugs tensors)."""
        self.shell(placement)
        return dict(self._slots[placement_key(placement)])

    @contextmanager
    def bare(self):
        """Hold the base and run the bare base model (no adapter)."""
        with self.lock:
            yield self.model

    @contextmanager
    def bind(self, placement: PlacementConfig, adapter: dict[str, torch.Tensor]):
        """Hold the base and run the shell with `adapter`'s tensors plugged in (no copy)."""
        shell = self.shell(placement)
        slots = self._slots[placement_key(placement)]
        if set(adapter) != set(slots):
            missing, extra = sorted(set(slots) - set(adapter)), sorted(set(adapter) - set(slots))
            raise KeyError(f"adapter does not match placement {placement.preset!r} rank {placement.rank}: "
                           f"missing {missing[:3]}, unexpected {extra[:3]}")
        with self.lock:
            for k, (module, attr) in slots.items():
                t = adapter[k]
                module._parameters[attr] = t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)
            yield shell

    def _share_base(self) -> nn.Module:
        from dsv4flash.model.transformer import Transformer

        shell = Transformer(self.cfg, torch.float32, "meta", seed=None)
        for name, param in self.model.named_parameters():
            owner, _, attr = name.rpartition(".")
            (shell.get_submodule(owner) if owner else shell)._parameters[attr] = param
        for name, buf in self.model.named_buffers():
            owner, _, attr = name.rpartition(".")
            (shell.get_submodule(owner) if owner else shell)._buffers[attr] = buf
        left = [n for n, t in list(shell.named_parameters()) + list(shell.named_buffers()) if t.is_meta]
        if left:
            raise RuntimeError(f"resident base: tensors {left[:3]} were not shared into the placement shell")
        return shell
