"""DSV41-VERL-009: veRL's Megatron engine builds the provider's own PEFT, so `make_megatron_module` gets the
decoder-half LoRA onto the CSA2 model (grouped `wo_a` adapters included; layer 6's KV write frozen at tiny size).

Everything is the real stack: `AutoBridge.from_hf_pretrained` on a dsv4flash base, veRL's `get_peft_cls` and
`make_megatron_module` (the engine's PEFT pre-wrap hook, DDP), megatron-bridge's PEFT transform.
"""

from __future__ import annotations

import pytest
import torch

from tests.mbridge.conftest import mbridge, mcore  # noqa: F401  (megatron-bridge on CPU, one Megatron session)
from tests.vllm._twins import stock

PATCH_ID = "DSV41-VERL-009"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from dsv4flash.config import load_config
    from dsv4flash.engine.model_io import save_base
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks import TaskTokenizer

    cfg = load_config("tiny")
    return save_base(Transformer(cfg, seed=0), cfg, TaskTokenizer(cfg), tmp_path_factory.mktemp("base") / "base",
                     {"kind": "test"})


@pytest.fixture(scope="module")
def lora_cfg():
    """The LoRA mapping `engine=verl` writes for `+recipe=decoder_lora` (decoder half, layer 6's KV write frozen)."""
    from dsv4flash.config import load_config
    from dsv4flash.train.compose import compose, to_train_config
    from dsv4flash.train.verl_config import _lora_settings

    cfg = to_train_config(compose("decoder_lora", ["engine=verl"]))
    prefix = "actor_rollout_ref.model.lora."
    return {k[len(prefix):]: v for k, v in _lora_settings(cfg, load_config("tiny")).items() if k.startswith(prefix)}


def _engine_build(base, lora_cfg):
    """What veRL's Megatron engine does for a LoRA actor: bridge, provider, `get_peft_cls`, `make_megatron_module`."""
    from megatron.core.transformer.enums import AttnBackend  # noqa: F401  (the engine imports it too)
    from verl.models.mcore.bridge import AutoBridge
    from verl.utils.megatron_utils import McoreModuleWrapperConfig, make_megatron_module
    from verl.workers.config import megatron_peft

    from dsv4flash.hf.registration import register_config, register_models
    from dsv4flash.integrations import mbridge

    register_config(), register_models(), mbridge.register()
    bridge = AutoBridge.from_hf_pretrained(str(base))
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.apply_overrides_and_finalize(dtype=torch.float32, overrides={"variable_seq_lengths": True})

    class ModelConfig:  # veRL's HFModelConfig carries `lora` as a mapping
        lora = lora_cfg

    peft = megatron_peft.get_peft_cls(ModelConfig(), bridge=bridge, provider=provider, dtype=torch.float32)
    module, tf_config = make_megatron_module(
        wrap_config=McoreModuleWrapperConfig(wrap_with_ddp=True, use_distributed_optimizer=False),
        tf_config=None, hf_config=bridge.hf_pretrained.config, bridge=bridge, provider=provider,
        override_ddp_config={"grad_reduce_in_fp32": True}, peft_cls=peft, peft_config=lora_cfg)
    return peft, module, tf_config


def test_make_megatron_module_builds_the_decoder_half_lora(patch_form, base, lora_cfg, mbridge, mcore):
    from dsv4flash.integrations.mbridge.grouped_lora import DSV41LoRA, grouped_adapters

    peft, module, tf_config = _engine_build(base, lora_cfg)
    assert isinstance(peft, DSV41LoRA) and (peft.dim, peft.alpha) == (lora_cfg["rank"], lora_cfg["alpha"])
    model = module[0].module
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all(".adapter." in n for n in trainable)  # the base is frozen
    layers = sorted({int(n.split(".")[2]) for n in trainable})
    assert layers == [6, 7, 8, 9, 10, 11]  # the decoder half of the tiny stack
    assert not any(n.startswith("decoder.layers.6.self_attention.linear_kv.") for n in trainable)  # frozen KV write
    assert any(n.startswith("decoder.layers.7.self_attention.linear_kv.") for n in trainable)
    grouped = sorted(grouped_adapters(model))
    assert grouped == sorted(f"decoder.layers.{i}.self_attention.linear_o_group_proj" for i in range(6, 12))
    ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = module[0](ids)
    patch_form.record("trainable", trainable)
    patch_form.record("peft", type(peft).__name__)
    patch_form.record("logits", logits[0, :4, :8], atol=1e-6)
    patch_form.record("recompute", [tf_config.recompute_granularity, tf_config.variable_seq_lengths])


def test_stock_verl_wraps_with_the_generic_lora_and_fails(base, lora_cfg, mbridge, mcore):
    with stock(PATCH_ID):
        with pytest.raises(NotImplementedError, match="unrecognized for LoRA: .*GroupedOutputProjection"):
            _engine_build(base, lora_cfg)
