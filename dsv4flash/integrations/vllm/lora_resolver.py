"""A vLLM `LoRAResolver` over the adapter catalog: `model="<policy>:<tag>"` served straight from the store.

Registered by the `vllm.general_plugins` entry point (`register()` in this package) when
`DSV4FLASH_LORA_STORE` names an adapter store (the directory or s3:// URL `dsv4flash serve --store` or the lifecycle uses).
A vLLM OpenAI server started with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` then resolves a
request for an unknown model name through it: a served model name of the grammar `dsv4flash.lifecycle.refs`
gives the OpenAI routes of `dsv4flash serve` too (`<policy>:<tag>`, e.g. `run-1:sampler_weights.step-3`;
`<policy>@<revision>`; `<policy>` for its head; a `tinker://<run>/<kind>/<name>` path), resolved by the same
`resolve_model_name`, so one name is one revision on both servers (vLLM has no tenants: it serves the whole store).
The revision is read from the store
(hash-verified, refused when its base fingerprint is not the served base's), and exported once per revision in
vLLM's packed 3-D MoE LoRA layout into the host cache directory (`DSV4FLASH_LORA_CACHE`, default
`<store>/vllm_lora_cache`: the CPU tier vLLM loads from), atomically. The LoRA id is derived from the revision
id, so one revision is one adapter slot however it is named.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolver

from dsv4flash.lifecycle.refs import lora_int_id, parse_model_name, resolve_model_name

log = logging.getLogger("dsv4flash.vllm")
RESOLVER_NAME = "dsv4flash catalog"
STORE_ENV, CACHE_ENV = "DSV4FLASH_LORA_STORE", "DSV4FLASH_LORA_CACHE"


class CatalogLoRAResolver(LoRAResolver):
    """Resolves catalog references to exported vLLM LoRA directories (exported once per revision)."""

    def __init__(self, store_root: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> None:
        from dsv4flash.lifecycle import AdapterStore
        from dsv4flash.lifecycle.default_store import local_dir_for

        self.store = AdapterStore(store_root)  # a directory, or an s3:// store (its exports cached on this machine)
        self.cache_dir = Path(cache_dir) if cache_dir else local_dir_for(self.store.root) / "vllm_lora_cache"
        self._base_digests: dict[str, str | None] = {}

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """A LoRARequest for `lora_name`, or None when it is not a catalog revision of this base."""
        try:
            parsed = parse_model_name(lora_name)
        except ValueError:
            return None
        return await asyncio.to_thread(self._resolve, base_model_name, lora_name, parsed)

    def _resolve(self, base_model_name: str, lora_name: str, parsed) -> LoRARequest | None:
        from dsv4flash.lifecycle.errors import LifecycleError

        try:
            rec = resolve_model_name(self.store.catalog, parsed)
        except (LifecycleError, KeyError, ValueError):
            return None
        expected = self._base_digest(base_model_name)
        if expected is not None and rec.base != expected:
            log.warning("%s: revision %s was trained on base %s, not the served %s (%s); not served", lora_name,
                        rec.id[:12], rec.base[:12], base_model_name, expected[:12])
            return None
        directory = self.cache_dir / rec.id[:32]
        if not (directory / "adapter_config.json").exists():
            self._export(rec.id, directory, base_model_name)
        return LoRARequest(lora_name=lora_name, lora_int_id=lora_int_id(rec.id), lora_path=str(directory))

    def _export(self, rev_id: str, directory: Path, base_model_name: str) -> None:
        from dsv4flash.lifecycle.export import export_vllm_3d
        from dsv4flash.lifecycle.packed import PackedMoELoRA
        from dsv4flash.lifecycle.revision import decode_adapter

        loaded = self.store.load(rev_id)  # hash-verified
        adapter = decode_adapter(loaded.tensors, loaded.manifest, source=f"revision {rev_id[:12]}")
        if not isinstance(adapter, PackedMoELoRA):  # a service checkpoint: flat tensors in the packed key layout
            placement = dict(loaded.manifest.extra.get("placement") or {})
            alpha = placement.get("alpha") or loaded.manifest.alpha
            if alpha is None:
                raise ValueError(f"revision {rev_id[:12]}: no LoRA alpha in its manifest; cannot export for vLLM")
            adapter = PackedMoELoRA.from_packed_tensors(adapter, alpha=float(alpha), source=f"revision {rev_id[:12]}")
        try:
            export_vllm_3d(adapter, directory, base_model_name_or_path=base_model_name)
        except FileExistsError:
            pass  # another process exported the same revision meanwhile (identical bytes)

    def _base_digest(self, base_model_name: str) -> str | None:
        """The fingerprint digest of the served base when its config can be read (a flavour or a directory)."""
        if base_model_name not in self._base_digests:
            from dsv4flash.config import ConfigError, load_config
            from dsv4flash.lifecycle import base_fingerprint

            try:
                self._base_digests[base_model_name] = base_fingerprint(load_config(base_model_name)).digest
            except (ConfigError, OSError, ValueError):
                self._base_digests[base_model_name] = None
        return self._base_digests[base_model_name]


def register_catalog_resolver() -> bool:
    """Register the resolver when `DSV4FLASH_LORA_STORE` is set (idempotent) -> whether it is registered."""
    from vllm.lora.resolver import LoRAResolverRegistry

    root = os.environ.get(STORE_ENV)
    if not root:
        return False
    if RESOLVER_NAME in LoRAResolverRegistry.get_supported_resolvers():
        return True
    from dsv4flash.lifecycle.default_store import no_store_at

    if no_store_at(root) is not None:
        raise ValueError(f"{STORE_ENV}={root}: not a directory (an adapter store root) or an s3:// store")
    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, CatalogLoRAResolver(root, os.environ.get(CACHE_ENV)))
    return True
