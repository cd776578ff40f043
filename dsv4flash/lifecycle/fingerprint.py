"""Base fingerprint: one hash that says "these adapter bytes were trained on this exact base".

fingerprint = sha256 over the canonical JSON of
  * the base config (`cfg.to_json()`, re-serialised with sorted keys so formatting never matters),
  * the tensor census: every base tensor as (name, dtype, shape), sorted by name,
  * the quantization plan: the stored role (`dsv4flash.release.quant_plan.quant_role`) of every census name.
Two bases with the same fingerprint accept the same adapters; anything else is a `BaseMismatchError`.
The digest is prefixed with a short human summary (model type, layers, hidden size, tensor count) so an
error message can say *how* two bases differ without a second lookup.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from dsv4flash.lifecycle.errors import BaseMismatchError

__all__ = [
    "BaseFingerprint",
    "fingerprint_from_parts",
    "base_fingerprint",
    "census_rows_from_state_dict",
    "checkpoint_fingerprint",
    "check_compatible",
]

CensusRow = tuple[str, str, tuple[int, ...]]


@dataclass(frozen=True)
class BaseFingerprint:
    """A base model's identity: `digest` decides compatibility, `summary` explains it to humans."""

    digest: str  # "sha256:<64 hex>"
    summary: str  # e.g. "deepseek_v41 L40 D5120 E384 tensors=91234"

    def __str__(self) -> str:
        return f"{self.digest[:19]}… ({self.summary})"

    def to_json(self) -> dict[str, str]:
        """Plain dict for manifests and catalog rows."""
        return {"digest": self.digest, "summary": self.summary}

    @classmethod
    def from_json(cls, data: Mapping[str, str] | str) -> "BaseFingerprint":
        """Inverse of `to_json` (also accepts a bare digest string)."""
        if isinstance(data, str):
            return cls(data, "")
        return cls(str(data["digest"]), str(data.get("summary", "")))


def _summary(config: dict[str, Any], n_tensors: int) -> str:
    text = config.get("text_config", config)
    parts = [str(config.get("model_type", text.get("model_type", "model")))]
    for key, short in (("num_hidden_layers", "L"), ("hidden_size", "D"), ("n_routed_experts", "E")):
        if key in text:
            parts.append(f"{short}{text[key]}")
    parts.append(f"tensors={n_tensors}")
    return " ".join(parts)


def fingerprint_from_parts(
    config_json: str | Mapping[str, Any],
    census_rows: Iterable[Sequence[Any]],
    quant_roles: Mapping[str, str] | None = None,
) -> BaseFingerprint:
    """Hash a base from its config JSON, census rows `(name, dtype, shape)` and per-name quant roles."""
    config = json.loads(config_json) if isinstance(config_json, str) else dict(config_json)
    rows: list[CensusRow] = []
    for row in census_rows:
        if len(row) < 3:
            raise ValueError(f"census row {row!r}: expected (name, dtype, shape)")
        name, dtype, shape = row[0], row[1], row[2]
        rows.append((str(name), str(dtype), tuple(int(s) for s in shape)))
    rows.sort()
    names = [r[0] for r in rows]
    if len(set(names)) != len(names):
        dup = next(n for i, n in enumerate(names[1:]) if n == names[i])
        raise ValueError(f"census lists tensor {dup!r} twice")
    if quant_roles is None:
        from dsv4flash.release.quant_plan import quant_role

        roles = {n: quant_role(n).value for n in names}
    else:
        missing = [n for n in names if n not in quant_roles]
        if missing:
            raise ValueError(f"quant roles missing for {len(missing)} census tensors, e.g. {missing[0]!r}")
        roles = {n: str(getattr(quant_roles[n], "value", quant_roles[n])) for n in names}
    canonical = json.dumps(
        {"config": config, "census": [[n, d, list(s)] for n, d, s in rows], "quant": roles},
        sort_keys=True,
        separators=(",", ":"),
    )
    digest = "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
    return BaseFingerprint(digest, _summary(config, len(rows)))


def census_rows_from_state_dict(state: Mapping[str, Any]) -> list[CensusRow]:
    """Census rows of a live base: `(name, dtype, shape)` for every tensor of a state dict."""
    return [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in state.items()]


def base_fingerprint(cfg: Any, census_rows: Iterable[Sequence[Any]] | None = None) -> BaseFingerprint:
    """Fingerprint of a `DSV41FlashConfig` base; the census defaults to the release census of `cfg`."""
    if census_rows is None:
        census_rows = _release_census(cfg)
    return fingerprint_from_parts(cfg.to_json(), census_rows)


def _release_census(cfg: Any) -> list[CensusRow]:
    # Imported lazily: the census builds the reference model on `meta`, which a catalog-only node
    # (no model code paths) never needs.
    from dsv4flash.release.census import census  # noqa: PLC0415

    return [(t.name, t.dtype, tuple(t.shape)) for t in census(cfg)]


def checkpoint_fingerprint(cfg: Any, directory: str) -> BaseFingerprint:
    """Fingerprint of a release checkpoint on disk (census read from its safetensors headers)."""
    from dsv4flash.release.census import checkpoint_census  # noqa: PLC0415

    return fingerprint_from_parts(cfg.to_json(), [(t.name, t.dtype, tuple(t.shape)) for t in checkpoint_census(directory)])


def check_compatible(adapter_fp: BaseFingerprint | str, resident_fp: BaseFingerprint | str, *, what: str) -> None:
    """Raise `BaseMismatchError` naming `what` unless the two fingerprints are the same base."""
    a = adapter_fp if isinstance(adapter_fp, BaseFingerprint) else BaseFingerprint.from_json(adapter_fp)
    r = resident_fp if isinstance(resident_fp, BaseFingerprint) else BaseFingerprint.from_json(resident_fp)
    if a.digest != r.digest:
        raise BaseMismatchError(
            f"{what} was trained on base {a} but the resident base is {r}; "
            "an adapter only loads on the exact base (config + tensor census + quantization plan) it was "
            "trained on — re-export it from a policy on this base or load the matching base"
        )
