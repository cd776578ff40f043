"""dsv4flash: LoRA post-training of DeepSeek-V4.1-Flash (reference model, bridge, plugins, lifecycle)."""

__version__ = "0.1.0"
