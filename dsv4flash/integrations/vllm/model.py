"""`DeepseekV41ForCausalLM` with LoRA: the vision wrapper declares `SupportsLoRA` and isolates adapters per image.

vLLM 0.33 registers the V4.1 vision wrapper without `SupportsLoRA`, so `--enable-lora` is rejected (docs/upstream.md
§3.1), although its language model supports LoRA. This subclass adds what the LoRA manager needs — the packed module
names of the language model *and* of the ViT (`wqkv`, fused `w1`), the tower / connector / language-model prefixes,
per-image token counts — and keys vision adapter state per image (`image_scope.ImageAdapterScope`). The plugin
registers it under the same architecture name.
"""

from __future__ import annotations

import contextlib

import torch
from vllm.model_executor.models.interfaces import SupportsLoRA
from vllm.model_executor.models.module_mapping import MultiModelKeys
from vllm.models.deepseek_v41.nvidia.vl_model import DeepseekV41ForCausalLM

from dsv4flash.integrations.vllm.image_scope import ImageAdapterScope

ARCH = "DeepseekV41ForCausalLM"
CLASS_PATH = "dsv4flash.integrations.vllm.model:DeepseekV41ForCausalLMWithLoRA"


class DeepseekV41ForCausalLMWithLoRA(DeepseekV41ForCausalLM, SupportsLoRA):
    """The V4.1 vision model with LoRA on the language model, and optionally on the ViT and aligner."""

    packed_modules_mapping = {
        "gate_up_proj": ["w1", "w3"],
        "fused_wqa_wkv": ["wq_a", "wkv"],
        "fused_wkv_wgate": ["wkv", "wgate"],
        # vision tower: fused qkv and fused gate/up, each one adapter in the checkpoint
        "wqkv": ["wqkv"],
        "w1": ["w1"],
    }
    embedding_modules: dict[str, str] = {}
    lora_skip_prefixes = ["mtp."]
    supports_tower_connector_lora = True
    per_image_lora_scope = True  # ViT/aligner adapter mapping is narrowed to each image (image_scope)

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        from dsv4flash.integrations.vllm import register

        register(model_code=True)  # the call-site twins must be live in whichever process builds the model
        lora = vllm_config.lora_config
        if lora is not None and lora.enable_tower_connector_lora and \
                getattr(vllm_config.compilation_config, "cudagraph_mm_encoder", False):
            raise ValueError("DeepSeek-V4.1 with enable_tower_connector_lora cannot use encoder CUDA graphs "
                             "(compilation_config.cudagraph_mm_encoder): a captured graph replays one adapter "
                             "mapping for every image; disable one of the two")
        super().__init__(vllm_config=vllm_config, prefix=prefix)

    @property
    def lora_manager(self):
        """The `LoRAModelManager` vLLM attaches (None before LoRA is set up)."""
        return self.__dict__.get("_lora_manager")

    @lora_manager.setter
    def lora_manager(self, manager) -> None:
        # The manager attaches itself right after building its punica wrappers: hook them now, before the
        # runner installs the first step's tower/connector mappings.
        self.__dict__["_lora_manager"] = manager
        ImageAdapterScope.of(self)

    def get_mm_mapping(self) -> MultiModelKeys:
        """Module prefixes of the language model, the aligner (connector) and the ViT (tower)."""
        return MultiModelKeys.from_string_field(language_model="language_model", connector="aligner",
                                                tower_model="vision.")

    def get_mm_lora_token_counts(self, *, modality: str, mm_kwargs, num_mm_embeds: int) -> tuple[int, int | None]:
        """(ViT tokens, aligner tokens) of one image: its patches and its h'·w' aligner rows."""
        return image_lora_token_counts(self.config, modality, mm_kwargs, num_mm_embeds)

    def _process_image_input(self, image_input):
        """Encode image by image under each image's own adapter when tower/connector LoRA is active."""
        if ImageAdapterScope.of(self) is None:
            return super()._process_image_input(image_input)
        # The DP-sharded ViT path encodes another rank's images; keep every image on the per-image path.
        with _attribute(self, "use_data_parallel", False):
            return super()._process_image_input(image_input)

    def _encode_image(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """One image through ViT and aligner with its request's adapter."""
        scope = ImageAdapterScope.of(self)
        if scope is None:
            return super()._encode_image(patches, n_vit_h, n_vit_w)
        ratio = self.config.vision_downsample_ratio
        with scope.image(patches.shape[0], (n_vit_h // ratio) * (n_vit_w // ratio)):
            return super()._encode_image(patches, n_vit_h, n_vit_w)


def image_lora_token_counts(config, modality: str, mm_kwargs, num_mm_embeds: int) -> tuple[int, int | None]:
    """Tower/connector token counts of one image item; an upper bound when `mm_kwargs` is None (budgeting)."""
    if modality != "image":
        raise ValueError(f"DeepSeek-V4.1 has no {modality!r} tower; only images")
    ratio = config.vision_downsample_ratio
    grid = mm_kwargs.get("vit_grid") if mm_kwargs else None
    grid = getattr(grid, "data", grid)
    if isinstance(grid, torch.Tensor):
        h, w = (int(v) for v in grid.reshape(-1, 2)[0].tolist())
        return h * w, (h // ratio) * (w // ratio)
    return num_mm_embeds * ratio**2, num_mm_embeds


@contextlib.contextmanager
def _attribute(obj, name: str, value):
    """Temporarily set an attribute."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)
