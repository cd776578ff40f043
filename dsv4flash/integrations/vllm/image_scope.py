"""Per-image adapter isolation for the vision tower and aligner (tower/connector LoRA).

vLLM's runner builds one TOWER and one CONNECTOR `LoRAMapping` per step, concatenating every scheduled
image's tokens in order, and then calls the encoder group by group; V4.1 encodes image by image. Each
encoder call therefore reads the punica metadata from row 0: the second image of a batch runs with the
first image's adapter (two requests with different adapters mix). `ImageAdapterScope` keys the adapter
state per image instead: it captures the step's mappings as the manager installs them and, around each
image's encode, narrows the tower and connector wrappers to that image's own adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from vllm.lora.layers import LoRAMapping, LoRAMappingType

SCOPE_ATTR = "_dsv4flash_image_scope"


@dataclass
class _Stream:
    """One wrapper (tower or connector): the step's mapping, the manager's arguments and the read cursor."""

    wrapper: object
    update: object  # the wrapper's own update_metadata (unintercepted)
    mapping: LoRAMapping | None = None
    args: tuple = ()
    item: int = 0
    offset: int = 0

    def capture(self, mapping: LoRAMapping, *args, **kwargs) -> None:
        """Interceptor for `update_metadata`: remember the step mapping, rewind, install it unchanged."""
        self.mapping, self.args, self.item, self.offset = mapping, args, 0, 0
        self.update(mapping, *args, **kwargs)

    def narrow(self, tokens: int, kind: LoRAMappingType, what: str) -> None:
        """Install the mapping of the next image only (its `tokens` rows, its request's adapter)."""
        if self.mapping is None:
            return
        if self.item >= len(self.mapping.prompt_mapping):
            raise RuntimeError(f"{what}: encoding image {self.item + 1} but this step's {kind.name} LoRA mapping "
                               f"covers {len(self.mapping.prompt_mapping)} image(s)")
        lora_id = self.mapping.prompt_mapping[self.item]
        rows = self.mapping.index_mapping[self.offset:self.offset + tokens]
        if len(rows) != tokens or any(r != lora_id for r in rows):
            raise RuntimeError(f"{what}: image {self.item} has {tokens} {kind.name.lower()} tokens but the step "
                               f"mapping disagrees at rows {self.offset}..{self.offset + tokens} (adapter "
                               f"{lora_id}); refusing to run it with another request's adapter")
        self.update(LoRAMapping((lora_id,) * tokens, (lora_id,), is_prefill=True, type=kind), *self.args)
        self.item += 1
        self.offset += tokens


class ImageAdapterScope:
    """Narrows the tower/connector punica wrappers of a `LoRAModelManager` to one image at a time."""

    def __init__(self, manager) -> None:
        self.manager = manager
        keys = manager.mm_mapping
        mapping = manager.punica_wrapper_mapping
        self.tower = self._intercept(mapping.get(keys.tower_model[0])) if keys.tower_model else None
        self.connector = self._intercept(mapping.get(keys.connector[0])) if keys.connector else None

    @staticmethod
    def _intercept(wrapper) -> _Stream | None:
        if wrapper is None:
            return None
        stream = _Stream(wrapper, wrapper.update_metadata)
        wrapper.update_metadata = stream.capture  # instance attribute: only this wrapper, only this model
        return stream

    @classmethod
    def of(cls, model) -> "ImageAdapterScope | None":
        """The scope of `model` (created on first use), or None when tower/connector LoRA is off."""
        manager = getattr(model, "lora_manager", None)
        if manager is None or not getattr(manager, "supports_tower_connector_lora", False):
            return None
        scope = model.__dict__.get(SCOPE_ATTR)
        if scope is None or scope.manager is not manager:
            scope = cls(manager)
            model.__dict__[SCOPE_ATTR] = scope
        return scope

    @contextlib.contextmanager
    def image(self, tower_tokens: int, connector_tokens: int) -> Iterator[None]:
        """Run one image's tower (`tower_tokens` ViT patches) and aligner (`connector_tokens` rows) in its scope."""
        if self.tower is not None:
            self.tower.narrow(tower_tokens, LoRAMappingType.TOWER, "vision tower LoRA")
        if self.connector is not None:
            self.connector.narrow(connector_tokens, LoRAMappingType.CONNECTOR, "aligner LoRA")
        try:
            yield
        finally:
            # The wrappers no longer hold what the manager last installed: force its next install through.
            self.manager._last_mapping = None
