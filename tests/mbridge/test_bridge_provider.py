"""`DSV41BridgeModelProvider` driven as veRL's Megatron engine drives a Megatron-Bridge provider: fields set by
name, `apply_overrides_and_finalize`, pre/post-wrap hooks and `provide_distributed_model` (real megatron-bridge)."""

from __future__ import annotations

import pytest
import torch

from dsv4flash_bridge.synthetic import write_release_checkpoint

pytestmark = [pytest.mark.upstream]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return write_release_checkpoint(tmp_path_factory.mktemp("rel") / "release", "tiny", shards=1, seed=3)


@pytest.fixture
def provider(mbridge, release):
    from megatron.bridge import AutoBridge

    return AutoBridge(mbridge.ReleasePretrained(release)).to_megatron_provider(load_weights=False)


def test_the_bridge_hands_out_a_model_provider_mixin(provider):
    from megatron.bridge.models.model_provider import ModelProviderMixin

    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider

    assert isinstance(provider, ModelProviderMixin) and isinstance(provider, DSV41ModelProvider)
    assert provider.num_layers == provider.dsv4.text.num_hidden_layers  # a megatron field reads as the config's
    assert provider.recompute_granularity is None and provider.overrides == {}


def test_overrides_set_one_at_a_time_then_finalize(provider):
    """veRL sets recompute_granularity before recompute_method: no validation until finalize()."""
    overrides = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
                 "variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall",
                 "expert_model_parallel_size": 1, "batch_p2p_comm": False}
    provider.apply_overrides_and_finalize(dtype=torch.float32, overrides=overrides)
    assert provider.overrides == {**overrides, "params_dtype": torch.float32, "fp16": False, "bf16": False}
    assert provider.recompute_method == "uniform" and provider.fp16 is False
    config = provider.transformer_config()
    assert (config.recompute_granularity, config.recompute_method, config.variable_seq_lengths) == (
        "full", "uniform", True)


def test_bad_overrides_name_the_field(provider):
    with pytest.raises(AttributeError, match="'no_such_field'"):
        provider.apply_overrides_and_finalize(overrides={"no_such_field": 1})
    provider.recompute_granularity = "full"  # without recompute_method: megatron-core refuses it at finalize
    with pytest.raises(ValueError, match="recompute_method"):
        provider.finalize()


def test_provide_distributed_model_runs_the_hooks_and_wraps_in_ddp(provider, mcore):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from dsv4flash.integrations.mcore.csa2 import DSV41MegatronModel, DSV41ModelProvider

    seen = []

    def freeze_embeddings(model):
        seen.append([type(m).__name__ for m in model])
        for name, p in model[0].named_parameters():
            p.requires_grad_(not name.startswith("embedding."))
        return model

    provider.register_pre_wrap_hook(freeze_embeddings)
    provider.register_post_wrap_hook(lambda model: seen.append([type(m).__name__ for m in model]) or model)
    provider.apply_overrides_and_finalize(dtype=torch.float32, overrides={"recompute_granularity": "full",
                                                                          "recompute_method": "uniform",
                                                                          "recompute_num_layers": 1})
    model = provider.provide_distributed_model(ddp_config=DistributedDataParallelConfig(), fp16=False, bf16=False)
    assert seen == [["DSV41MegatronModel"], ["DistributedDataParallel"]]
    assert len(model) == 1 and isinstance(model[0], DistributedDataParallel)
    inner = model[0].module
    assert isinstance(inner, DSV41MegatronModel) and inner.config.recompute_method == "uniform"
    plain = DSV41ModelProvider(provider.dsv4).provide()
    assert inner.state_dict().keys() == plain.state_dict().keys()  # the same model as provide() builds
    trainable = {n for n, p in inner.named_parameters() if p.requires_grad}
    assert trainable and not any(n.startswith("embedding.") for n in trainable)
    ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model[0](ids)).all()
