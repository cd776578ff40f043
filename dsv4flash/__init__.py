"""dsv4flash: LoRA post-training of DeepSeek-V4.1-Flash (reference model, bridge, plugins, lifecycle)."""

__version__ = "0.1.0"

# transformers learns `deepseek_v41` once its auto classes are imported (nothing is imported here).
from dsv4flash.hf.registration import install as _install_transformers_classes

_install_transformers_classes()
