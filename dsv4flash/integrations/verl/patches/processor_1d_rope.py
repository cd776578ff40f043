"""Runtime twin of DSV41-VERL-011: `hf_processor` keeps the processor of a multimodal model with 1-D RoPE.

Why: `verl.utils.tokenizer.hf_processor` binds a model's `get_rope_index` (multimodal RoPE position ids) onto
the processors it knows (Qwen2/2.5/3-VL, GLM-4V, ...) and raises "Unsupported processor type" for any other,
which its own `except` turns into `processor=None`. A multimodal model whose positions are plain token
indices (DeepSeek-V4.1's `DeepseekV41Processor`, like Gemma 4) has nothing to bind, but loses its processor,
and `RLHFDataset` then asserts "processor is needed to process multimodal data".

How: the upstream form adds `uses_multimodal_rope(config)` (an `mrope_section` in the config's or its text
config's `rope_scaling` / `rope_parameters`) and keeps an unlisted processor when it is false (still an error
when true: such a model needs its `get_rope_index` bound). The twin replaces `hf_processor` where veRL binds it:
an unlisted processor of a 1-D RoPE model is returned (with `processor.config`, as stock sets), everything
else goes to the stock function unchanged.
"""

from __future__ import annotations

import sys
from typing import Any

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.verl.patches import verl_twin

TOUCHES = ("verl.utils.tokenizer.tokenizer.hf_processor",)
# Where veRL 0.9.1 binds `hf_processor` by name (besides its home module).
IMPORTERS = ("verl.utils.tokenizer", "verl.utils", "verl.workers.config.model", "verl.model_merger.base_model_merger",
             "verl.model_merger.megatron_model_merger")
# The processors stock veRL 0.9.1 binds a rope index for (or knows need none): left to the stock function.
STOCK_KNOWN = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor", "Glm4vProcessor", "Glm46VProcessor",
               "MllamaProcessor", "Gemma4Processor")


def uses_multimodal_rope(config: Any) -> bool:
    """Whether `config` (or its `text_config`) has multimodal RoPE (an `mrope_section`)."""
    for cfg in (config, getattr(config, "text_config", None)):
        for key in ("rope_scaling", "rope_parameters"):
            rope = getattr(cfg, key, None)
            if isinstance(rope, dict) and "mrope_section" in rope:
                return True
    return False


def upstream_keeps_1d_rope_processors() -> bool:
    """Probe: does veRL have `uses_multimodal_rope`, false for a 1-D RoPE config and true for an mrope one?"""
    from types import SimpleNamespace

    from verl.utils.tokenizer import tokenizer

    probe = getattr(tokenizer, "uses_multimodal_rope", None)
    if not callable(probe) or getattr(probe, "__module__", "").startswith("dsv4flash"):
        return False
    return (not probe(SimpleNamespace(rope_scaling={"rope_type": "yarn"}))
            and probe(SimpleNamespace(rope_scaling={"mrope_section": [16, 24, 24]})))


@verl_twin(
    patch_id="DSV41-VERL-011",
    touches=TOUCHES,
    gate="DSV4FLASH_VERL_PROCESSOR_1D_ROPE",
    tests=("tests/verl/test_processor_1d_rope.py",),
    upstream_has_it=upstream_keeps_1d_rope_processors,
)
def install(patcher: Patcher) -> None:
    """Replace `hf_processor` in its module and in the already-imported modules that bound it by name."""
    from verl.utils.tokenizer import tokenizer

    stock = tokenizer.hf_processor

    def hf_processor(name_or_path, **kwargs):
        """veRL's `hf_processor`, keeping an unlisted processor of a model without multimodal RoPE."""
        from transformers import AutoConfig, AutoProcessor, PreTrainedTokenizerBase

        try:
            processor = AutoProcessor.from_pretrained(name_or_path, **kwargs)
            config = AutoConfig.from_pretrained(name_or_path, **kwargs)
        except Exception:  # stock warns and returns None for what cannot load
            return stock(name_or_path, **kwargs)
        name = type(processor).__name__
        if (isinstance(processor, PreTrainedTokenizerBase) or name in STOCK_KNOWN or "Processor" not in name
                or uses_multimodal_rope(config)):
            return stock(name_or_path, **kwargs)
        processor.config = config
        return processor

    for module in (tokenizer, *(sys.modules.get(m) for m in IMPORTERS)):
        if module is not None and getattr(module, "hf_processor", None) is stock:
            patcher.replace(module, "hf_processor", hf_processor)
