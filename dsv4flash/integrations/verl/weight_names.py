"""Base-weight names during an unmerged (merge=False) adapter sync: ask the live vLLM loader, do not guess.

A LoRA-wrapped vLLM module keeps its base weight at `<module>.base_layer.weight`. Whether the model's
`load_weights` wants the incoming base name with or without `.base_layer.` depends on the model's loader
(V4.1's accepts both, generic `AutoWeightsLoader` models on vLLM 0.33 only the plain name, older vLLM only the
`.base_layer.` one) — veRL 0.9.1 decides from a vLLM-version flag and a `.mlp.experts.` naming convention.
`LoaderNaming.probe` dry-runs the live loader: every parameter's `weight_loader` is swapped for a recorder
(nothing is written), one name is offered in both spellings, and the spelling that lands on a `.base_layer.`
parameter wins. The result is cached per model.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

BASE = ".base_layer."
_cache: "weakref.WeakKeyDictionary[torch.nn.Module, LoaderNaming]" = weakref.WeakKeyDictionary()


def strip_base_layer(name: str) -> str:
    """`a.base_layer.weight` -> `a.weight` (one segment)."""
    return name.replace(BASE, ".", 1)


def add_base_layer(name: str) -> str:
    """`a.weight` -> `a.base_layer.weight` (leaf inserted before the last component)."""
    head, _, leaf = name.rpartition(".")
    return f"{head}{BASE}{leaf}" if head else name


@dataclass(frozen=True)
class LoaderNaming:
    """How a live model's loader spells wrapped base weights: `plain`, `base_layer` or `either`."""

    scheme: str
    probed_with: str = ""

    @classmethod
    def probe(cls, model: torch.nn.Module, names: Iterable[str]) -> "LoaderNaming":
        """Dry-run `model.load_weights` on the first of `names` that addresses a LoRA-wrapped base weight."""
        if not any(BASE in n for n, _ in model.named_parameters(remove_duplicate=False)):
            return cls("either")  # nothing is wrapped: names pass unchanged
        for name in names:
            plain = strip_base_layer(name)
            based = add_base_layer(plain)
            reached = {s for s in (plain, based) if BASE in (_dry_run(model, s) or "")}
            if reached:
                scheme = "either" if len(reached) == 2 else ("plain" if plain in reached else "base_layer")
                return cls(scheme, plain)
        return cls("either")


def loader_naming(model: torch.nn.Module, names: Iterable[str]) -> LoaderNaming:
    """`LoaderNaming.probe` cached per live model (re-probed only while no wrapped name has been seen)."""
    cached = _cache.get(model)
    if cached is not None and cached.probed_with:
        return cached
    naming = LoaderNaming.probe(model, names)
    _cache[model] = naming
    return naming


def resolve_names(model: torch.nn.Module, names: list[str]) -> list[str]:
    """Every name in the spelling the model's loader accepts for it (probing once per model)."""
    naming = loader_naming(model, names)
    if naming.scheme == "either":
        return list(names)
    if naming.scheme == "plain":
        return [strip_base_layer(n) for n in names]
    # Inserting `.base_layer.` is only right for wrapped modules: ask the loader per name (cheap dry runs).
    out = []
    for name in names:
        plain = strip_base_layer(name)
        target = _dry_run(model, add_base_layer(plain)) if BASE not in name else None
        out.append(add_base_layer(plain) if target is not None and BASE in target else name)
    return out


@contextlib.contextmanager
def _recording(model: torch.nn.Module) -> Iterator[list[str]]:
    """Every parameter's loader records its own name instead of writing; restored afterwards."""
    hits: list[str] = []
    saved = []
    for name, param in model.named_parameters(remove_duplicate=False):
        had = hasattr(param, "weight_loader")  # plain attribute, or vLLM parameters' property
        saved.append((param, had, getattr(param, "weight_loader", None)))
        param.weight_loader = (lambda *args, _n=name, **kw: hits.append(_n) or True)
    finalize = model.__dict__.get("process_weights_after_loading")
    model.__dict__["process_weights_after_loading"] = lambda *a, **k: None  # no post-load side effects
    try:
        yield hits
    finally:
        for param, had, loader in saved:
            if had:
                param.weight_loader = loader
            else:
                del param.weight_loader
        if finalize is None:
            model.__dict__.pop("process_weights_after_loading", None)
        else:
            model.__dict__["process_weights_after_loading"] = finalize


def _dry_run(model: torch.nn.Module, name: str) -> str | None:
    """The parameter `model.load_weights([(name, ·)])` would write, or None if the loader rejects the name."""
    with _recording(model) as hits:
        try:
            model.load_weights([(name, torch.zeros(1))])
        except (KeyError, ValueError, AttributeError, AssertionError, RuntimeError, IndexError):
            return None
    return hits[0] if hits else None
