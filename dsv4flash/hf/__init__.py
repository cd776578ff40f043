"""transformers classes for DeepSeek-V4.1-Flash: `DeepseekV41Config`, `DeepseekV41ForCausalLM` (docs/transformers.md).

Importing this package is cheap; the classes import transformers when first accessed. `import dsv4flash`
registers them with transformers' auto classes lazily (`registration.install`).
"""

from __future__ import annotations

__all__ = ["DeepseekV41Config", "DeepseekV41TextConfig", "DeepseekV41VisionConfig", "DeepseekV41ForCausalLM",
           "DeepseekV41PreTrainedModel", "DeepseekV41ImageProcessor", "DeepseekV41Processor"]

_HOMES = {"DeepseekV41Config": "configuration", "DeepseekV41TextConfig": "configuration",
          "DeepseekV41VisionConfig": "configuration", "DeepseekV41ForCausalLM": "modeling",
          "DeepseekV41PreTrainedModel": "modeling", "DeepseekV41ImageProcessor": "processing",
          "DeepseekV41Processor": "processing"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'dsv4flash.hf' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"dsv4flash.hf.{_HOMES[name]}"), name)
