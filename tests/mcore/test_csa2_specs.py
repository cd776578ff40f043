"""The CSA2 layers are megatron-core citizens: ModuleSpecs, `TransformerLayer` subclasses, validated configs."""

from __future__ import annotations

import pytest
import torch

from tests.mcore import csa2_support as sup
from tests.mcore_cpu import parallel

pytestmark = pytest.mark.upstream


@pytest.fixture(scope="module")
def mcore():
    """One single-rank Megatron session for the module."""
    with parallel.model_parallel(seed=1234), sup.single_thread():
        yield


@pytest.fixture(scope="module")
def config(mcore):
    """The tiny model's CSA2TransformerConfig."""
    from dsv4flash.integrations.mcore.csa2 import transformer_config_from

    return transformer_config_from("tiny")


def test_block_spec_follows_the_layer_plan(config):
    from megatron.core.transformer.spec_utils import ModuleSpec

    from dsv4flash.integrations.mcore.csa2 import CSA2TransformerLayer, get_csa2_block_spec
    from dsv4flash.integrations.mcore.router import ModalityMoELayer, ModalityTopKRouter

    spec = get_csa2_block_spec(config)
    assert len(spec.layer_specs) == 12
    for plan, layer in zip(config.dsv4.backbone_plan, spec.layer_specs):
        assert isinstance(layer, ModuleSpec) and layer.module is CSA2TransformerLayer
        attn = layer.submodules.self_attention.submodules
        assert (attn.compressor is not None) == plan.has_compressor
        assert (attn.indexer is not None) == plan.has_indexer
        assert (layer.submodules.engram is not None) == plan.has_engram
        mlp = layer.submodules.mlp
        assert mlp.func is ModalityMoELayer and mlp.keywords["submodules"].router is ModalityTopKRouter


def test_built_layers_are_transformer_layers_with_the_release_roles(config):
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer, TransformerLayer

    from dsv4flash.integrations.mcore.csa2 import get_csa2_layer_spec

    layers = {i: build_module(get_csa2_layer_spec(config, i), config=config, layer_number=i + 1) for i in (2, 4, 6, 8)}
    for layer in layers.values():
        assert isinstance(layer, TransformerLayer) and isinstance(layer, BaseTransformerLayer)
        assert layer.is_moe_layer
    assert layers[2].self_attention.compressor.linear_gate is not None  # ratio 2: gated pooling
    assert layers[6].self_attention.compressor.linear_gate is None  # ratio 1: the CED source has no wgate
    assert layers[4].engram is not None and layers[2].engram is None
    assert layers[8].self_attention.compressor is None and layers[8].self_attention.indexer.linear_k is None
    assert layers[2].self_attention.compressor.linear_kv.weight.dtype == torch.float32


def test_layer_refuses_a_call_without_the_csa2_carry(config):
    from megatron.core.transformer.spec_utils import build_module

    from dsv4flash.integrations.mcore.csa2 import get_csa2_layer_spec

    layer = build_module(get_csa2_layer_spec(config, 0), config=config, layer_number=1)
    with pytest.raises(TypeError, match="CSA2 carry"):
        layer(hidden_states=torch.zeros(4, 1, 4 * 64), context=None)


@pytest.mark.parametrize("override, message", [
    ({"pipeline_model_parallel_size": 2, "pipeline_dtype": torch.float32}, "variable_seq_lengths"),
    ({"pipeline_model_parallel_size": 2, "pipeline_dtype": torch.bfloat16, "variable_seq_lengths": True},
     "pipeline_dtype"),
    ({"bias_activation_fusion": True}, "swiglu_limit"),
    ({"cp_layout": "ring"}, "cp_layout"),
    ({"recompute_granularity": "selective", "recompute_modules": ["layernorm"]}, "recompute_modules"),
    ({"num_layers": 3}, "num_layers"),
])
def test_config_rejects_what_the_stack_cannot_do(mcore, override, message):
    from dsv4flash.integrations.mcore.csa2 import transformer_config_from

    with pytest.raises(ValueError, match=message):
        transformer_config_from("tiny", **override)


def test_provider_validates_its_options(mcore):
    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider

    with pytest.raises(ValueError, match="recompute"):
        DSV41ModelProvider("tiny", recompute="sometimes").transformer_config()
    with pytest.raises(ValueError, match="transformer_engine"):
        DSV41ModelProvider("tiny", moe_grouped_gemm=True).transformer_config()
    with pytest.raises(ValueError, match="pipeline_model_parallel_size > 1"):
        DSV41ModelProvider("tiny").provide(pre_process=False)
    with pytest.raises(ValueError, match="vp_stage"):
        DSV41ModelProvider("tiny").provide(vp_stage=1)


def test_selective_core_attention_and_moe_recompute_keep_gradients_exact(mcore):
    ref = sup.reference(seed=0)
    ids = sup.token_ids(1, 32, seed=51)
    weights = sup.probe((1, 32, sup.VOCAB), seed=52)
    runs = []
    for overrides in ({}, {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "moe"]}):
        model = sup.megatron_from(ref, overrides=overrides)
        (model(ids) * weights).sum().backward()
        runs.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert runs[0].keys() == runs[1].keys()
    for name, grad in runs[0].items():
        assert torch.equal(runs[1][name], grad), name


def test_distributed_checkpoint_round_trip(mcore, tmp_path):
    from megatron.core import dist_checkpointing

    model = sup.megatron_from(sup.reference(seed=0))
    sharded = model.sharded_state_dict()
    # Heterogeneous layers are never stacked: each Full layer's compressor is its own checkpoint tensor.
    keys = {v.key for k, v in sharded.items() if k.endswith("compressor.linear_kv.weight")}
    assert keys == {f"decoder.layers.{i}.self_attention.compressor.linear_kv.weight" for i in (2, 4, 6)}
    dist_checkpointing.save(sharded, str(tmp_path))
    other = sup.megatron_from(sup.reference(seed=9))
    other.load_state_dict(dist_checkpointing.load(other.sharded_state_dict(), str(tmp_path)))
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), name


def test_engram_slot_takes_the_host_pinned_table(mcore):
    from dsv4flash.integrations.mcore.engram import PinnedEngram

    ref = sup.reference(seed=0)
    model = sup.megatron_from(ref, engram=PinnedEngram)
    assert type(model.decoder.layers[1].engram) is PinnedEngram and model.decoder.layers[0].engram is None
    assert not any(".engram.embed" in name for name, _ in model.named_parameters())  # the table is not a parameter
    ids = sup.token_ids(1, 40, seed=53)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), rtol=0, atol=1e-5)


def test_block_without_engram_rows_names_the_fix(mcore):
    model = sup.megatron_from(sup.reference(seed=0))
    hidden = model.embedding(sup.token_ids(1, 16, seed=54), None)
    with pytest.raises(ValueError, match="csa2_tokens"):
        model.decoder(hidden, None)  # a bare block call: no input ids, so no Engram rows for layer 1


def test_float16_module_keeps_the_release_fp32_islands(mcore):
    from megatron.core.transformer.module import Float16Module

    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state
    from dsv4flash.model.transformer import Transformer

    ref32 = sup.reference(seed=0)
    model = DSV41ModelProvider(ref32.cfg, overrides=dict(bf16=True, params_dtype=torch.bfloat16,
                                                         pipeline_dtype=torch.bfloat16)).provide()
    load_reference_state(model, ref32.state_dict())
    wrapped = Float16Module(model.config, model)  # casts the whole model with .bfloat16()
    plan = ref32.cfg.backbone_plan
    for name, param in wrapped.named_parameters():
        layer = int(name.split(".")[3]) if name.startswith("module.decoder.layers.") else None
        fp32 = (any(key in name for key in ("hyper_connection.", "attn_sink", "output_layer"))
                or (".compressor.linear_" in name and plan[layer].ratio > 1)  # REF: ratio-1 compressor is bf16
                or (name.startswith("module.vision_model.") and "layernorm" in name))  # REF: fp32 ViT norms
        assert (param.dtype == torch.float32) == fp32, f"{name}: {param.dtype}"
    # Exact release values, not a bf16 round trip.
    assert torch.equal(model.decoder.layers[2].self_attn_hyper_connection.fn, ref32.layers[2].hc_attn_fn)
    ref = Transformer(ref32.cfg, dtype=torch.bfloat16, seed=None)
    ref.load_state_dict(ref32.state_dict())
    ids = sup.token_ids(1, 48, seed=55)
    with torch.no_grad():
        got, want = wrapped(ids).float().flatten(), ref(ids).float().flatten()
    assert float(torch.nn.functional.cosine_similarity(got, want, dim=0)) > 0.999


def test_float16_module_keeps_fp32_islands_behind_a_lora_wrapper(mcore):
    """A LoRA on the ratio > 1 compressor (`linear_kv` matches it): the island and its adapter stay fp32."""
    from megatron.core.transformer.module import Float16Module

    from dsv4flash.integrations import mbridge
    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state
    from tests.mbridge import shim

    shim.install()
    ref = sup.reference(seed=0)
    model = DSV41ModelProvider(ref.cfg, overrides=dict(bf16=True, params_dtype=torch.bfloat16,
                                                       pipeline_dtype=torch.bfloat16)).provide()
    load_reference_state(model, ref.state_dict())
    model = mbridge.DSV41LoRA(target_modules=["linear_kv"], dim=4, alpha=8)(model, training=True)
    wrapped = Float16Module(model.config, model)
    plan = ref.cfg.backbone_plan
    islands = [i for i, layer in enumerate(plan) if layer.ratio > 1 and layer.has_compressor]
    assert islands
    for name, param in wrapped.named_parameters():
        if ".compressor.linear_kv." not in name:
            continue
        fp32 = plan[int(name.split(".")[3])].ratio > 1
        assert (param.dtype == torch.float32) == fp32, f"{name}: {param.dtype}"
    base = model.decoder.layers[islands[0]].self_attention.compressor.linear_kv.to_wrap.weight
    assert torch.equal(base, ref.layers[islands[0]].attn.compressor.wkv.weight)  # exact, not a bf16 round trip
    ids = sup.token_ids(1, 32, seed=56)
    wrapped(ids).float().sum().backward()  # fp32 island input, fp32 adapter: runs (bf16 adapter: dtype error)
