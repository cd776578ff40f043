"""Registration of the V4.1 classes with transformers' auto classes (lazy, idempotent, thread-safe).

`install()` (run by `import dsv4flash`, and by the veRL and vLLM plugins, which import dsv4flash) never
imports transformers itself: `AutoConfig` learns `deepseek_v41` when transformers' `configuration_auto`
is imported (at once if it already is), and `AutoModelForCausalLM` / `AutoModelForImageTextToText` learn
`DeepseekV41ForCausalLM` when `modeling_auto` is, and `AutoProcessor` the V4.1 processor
(`dsv4flash.hf.processing`) when `processing_auto` is. The release's `architectures` is
`DeepseekV41ForCausalLM` on a model with a vision tower, so it is both a causal LM and an image-text-to-text
model.

A `deepseek_v41` config class registered before ours is kept: vLLM registers its own (flat attributes, for
its model code) when `get_config` loads a V4.1 checkpoint, and that process's engine depends on it.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["install", "register_config", "register_models", "register_processors", "MODEL_TYPE"]

MODEL_TYPE = "deepseek_v41"
CONFIG_AUTO = "transformers.models.auto.configuration_auto"
MODELING_AUTO = "transformers.models.auto.modeling_auto"
PROCESSING_AUTO = "transformers.models.auto.processing_auto"
log = logging.getLogger("dsv4flash.hf")
_lock = threading.RLock()
_done: set[str] = set()


def register_config() -> None:
    """AutoConfig: `deepseek_v41` -> DeepseekV41Config (once; a class someone registered first is kept)."""
    with _lock:
        if "config" in _done:
            return
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        from dsv4flash.hf.configuration import DeepseekV41Config

        if MODEL_TYPE in CONFIG_MAPPING:
            # vLLM registers its own flat DeepseekV41Config when it loads a V4.1 model (its model code reads
            # flat attributes); replacing it would break that process's engine.
            log.info("AutoConfig already maps %s to %s; keeping it", MODEL_TYPE, CONFIG_MAPPING[MODEL_TYPE])
        else:
            AutoConfig.register(MODEL_TYPE, DeepseekV41Config)
        _done.add("config")


def register_models() -> None:
    """AutoModelForCausalLM and AutoModelForImageTextToText: DeepseekV41Config -> DeepseekV41ForCausalLM (once)."""
    with _lock:
        if "models" in _done:
            return
        register_config()
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from dsv4flash.hf.configuration import DeepseekV41Config
        from dsv4flash.hf.modeling import DeepseekV41ForCausalLM

        for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
            auto.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)
        _done.add("models")


def register_processors() -> None:
    """AutoProcessor: DeepseekV41Config -> DeepseekV41Processor (once).

    Not AutoImageProcessor: transformers 5 gates that auto class on torchvision, which the processor does not need.
    """
    with _lock:
        if "processors" in _done:
            return
        register_config()
        from transformers.models.auto.processing_auto import AutoProcessor

        from dsv4flash.hf.configuration import DeepseekV41Config
        from dsv4flash.hf.processing import DeepseekV41Processor

        AutoProcessor.register(DeepseekV41Config, DeepseekV41Processor, exist_ok=True)
        _done.add("processors")


def install() -> None:
    """Register when transformers' auto modules are imported (now for those already imported)."""
    from dsv4flash.patching.post_import import when_imported

    when_imported(CONFIG_AUTO, register_config)
    when_imported(MODELING_AUTO, register_models)
    when_imported(PROCESSING_AUTO, register_processors)
