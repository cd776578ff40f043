"""`DeepseekV41Config`: the release `config.json` as a transformers `PreTrainedConfig` (model_type `deepseek_v41`).

The nested `text_config` / `vision_config` sections are sub-configs whose fields are generated from
`dsv4flash.config.TextConfig` / `VisionConfig`, the one source of architecture truth, with the release
(flash) values as defaults; validation and serialisation go through `DSV41FlashConfig` (`to_dsv4flash`,
`DSV41FlashConfig.to_hf`), so a saved `config.json` has exactly the release's keys, order and values.
`quantization_config` describes how the weights are *stored*; it is optional (the checkpoint bridge's BF16
imports drop it) and does not change the model.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

from transformers import PreTrainedConfig

from dsv4flash.config import (_ROOT_KEYS, DSV41FlashConfig, QuantizationConfig, TextConfig, VisionConfig,
                              load_config)

__all__ = ["DeepseekV41Config", "DeepseekV41TextConfig", "DeepseekV41VisionConfig"]

_FLASH = load_config("flash")


def _plain(value: Any) -> Any:
    """A dataclass value as JSON-ready data (tuples -> lists, nested dataclasses -> dicts)."""
    if dataclasses.is_dataclass(value):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _section_class(name: str, section: type, defaults: Any, base_key: str) -> type:
    """A PreTrainedConfig subclass with one field per `section` field (release defaults), in release order."""
    annotations, namespace, aliased = {}, {}, {}
    for f in dataclasses.fields(section):
        if f.name == "model_type":
            continue  # a class attribute in transformers
        value = _plain(getattr(defaults, f.name))
        if isinstance(getattr(PreTrainedConfig, f.name, None), property):
            # transformers aliases `rope_scaling` to `rope_parameters` by a property: set it through that
            # property, unstandardised (the release's YaRN section applies to compressed layers only).
            aliased[f.name] = value
            continue
        annotations[f.name] = Any
        # Mutable defaults need a factory (dataclass rule); each instance gets its own copy.
        namespace[f.name] = dataclasses.field(default_factory=lambda v=value: json.loads(json.dumps(v))) \
            if isinstance(value, (list, dict)) else value
    namespace.update(__annotations__=annotations, __module__=__name__, model_type=defaults.model_type,
                     base_config_key=base_key, section=section,
                     __doc__=f"`{base_key}` of the release config.json (dsv4flash.config.{section.__name__} fields).")

    def section_dict(self) -> dict[str, Any]:
        """This section as the release writes it (its keys in release order)."""
        out = {}
        for f in dataclasses.fields(self.section):
            value = self.model_type if f.name == "model_type" else getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def __post_init__(self, **kwargs) -> None:
        for key, value in aliased.items():
            kwargs.setdefault(key, json.loads(json.dumps(value)))
        PreTrainedConfig.__post_init__(self, **kwargs)

    namespace.update(section_dict=section_dict, __post_init__=__post_init__)
    return type(name, (PreTrainedConfig,), namespace)


DeepseekV41TextConfig = _section_class("DeepseekV41TextConfig", TextConfig, _FLASH.text, "text_config")
DeepseekV41VisionConfig = _section_class("DeepseekV41VisionConfig", VisionConfig, _FLASH.vision, "vision_config")


class DeepseekV41Config(PreTrainedConfig):
    """DeepSeek-V4.1-Flash `config.json` (defaults: the release); `to_dsv4flash()` gives the typed config."""

    model_type: ClassVar[str] = "deepseek_v41"
    sub_configs: ClassVar[dict] = {"text_config": DeepseekV41TextConfig, "vision_config": DeepseekV41VisionConfig}
    keys_to_ignore_at_inference: ClassVar[list] = ["past_key_values"]

    architectures: Any = dataclasses.field(default_factory=lambda: list(_FLASH.architectures))
    dtype: Any = _FLASH.dtype
    transformers_version: Any = _FLASH.transformers_version  # kept as loaded, so a re-save is byte-identical
    bos_token_id: Any = _FLASH.bos_token_id
    eos_token_id: Any = _FLASH.eos_token_id
    pad_token_id: Any = _FLASH.pad_token_id
    image_token_id: Any = _FLASH.image_token_id
    quantization_config: Any = dataclasses.field(default_factory=lambda: _plain(_FLASH.quantization))
    text_config: Any = None
    vision_config: Any = None
    tie_word_embeddings: Any = False  # V4.1 has a separate fp32 head (not part of config.json)

    def __post_init__(self, **kwargs) -> None:
        for key, cls in self.sub_configs.items():
            value = getattr(self, key)
            if value is None:
                setattr(self, key, cls())
            elif isinstance(value, dict):
                setattr(self, key, cls(**value))
        super().__post_init__(**kwargs)
        self.to_dsv4flash()  # validate now: every rule names the offending key

    # ---- the dsv4flash view --------------------------------------------------------------------
    def release_dict(self) -> dict[str, Any]:
        """The config.json dict, keys in release order (`quantization_config` left out when None)."""
        values = {"architectures": list(self.architectures or []), "model_type": self.model_type,
                  "dtype": _dtype_name(self.dtype), "transformers_version": self.transformers_version,
                  "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                  "pad_token_id": self.pad_token_id, "image_token_id": self.image_token_id,
                  "quantization_config": self.quantization_config,
                  "text_config": self.text_config.section_dict(), "vision_config": self.vision_config.section_dict()}
        return {k: values[k] for k in _ROOT_KEYS if not (k == "quantization_config" and values[k] is None)}

    def to_dsv4flash(self) -> DSV41FlashConfig:
        """The typed, validated dsv4flash config (the stored quantization defaults to the release's)."""
        data = self.release_dict()
        data.setdefault("quantization_config", _plain(QuantizationConfig()))
        return DSV41FlashConfig.from_hf(data, name=self.name_or_path or "custom", source=self.name_or_path or
                                        "DeepseekV41Config")

    @classmethod
    def from_dsv4flash(cls, cfg: DSV41FlashConfig | str, **kwargs) -> "DeepseekV41Config":
        """From a dsv4flash config or flavour name (`tiny`, `flash`, `tiny_mtp`)."""
        return cls(**{**load_config(cfg).to_hf(), **kwargs})

    # ---- serialisation: exactly the release schema ---------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The release config.json dict (transformers' runtime attributes are not part of it)."""
        data = self.to_dsv4flash().to_hf()
        if self.quantization_config is None:
            data.pop("quantization_config")
        return data

    def to_diff_dict(self) -> dict[str, Any]:
        """Same as `to_dict`: the release format has no defaults to leave out."""
        return self.to_dict()

    def to_json_string(self, use_diff: bool = True) -> str:
        """Serialised exactly as the release's config.json (indent 2, release key order)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"


def _dtype_name(dtype: Any) -> Any:
    """'bfloat16' for torch.bfloat16 (transformers turns the config's dtype string into a torch.dtype)."""
    return str(dtype).removeprefix("torch.") if dtype is not None and not isinstance(dtype, str) else dtype
