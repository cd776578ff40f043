"""DSV41-VERL-004: veRL's R3 routing replay, text-only, on a real megatron-core model with the modality router.

veRL's own replay patch is applied (`apply_router_replay_patch`, R3 as the Megatron engine does); routing goes
through `dsv4flash.integrations.mcore.router.ModalityTopKRouter`, which keeps sqrtsoftplus and the per-token
text/image bias that veRL's replacement `routing` lacks (docs/upstream.md §4.2).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from dsv4flash.replay import ImageSpanLayout, r3_batch_keys
from tests.vllm._twins import stock

PATCH_ID = "DSV41-VERL-004"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]
S_VOCAB, E, K = 64, 8, 2
LAYOUT = ImageSpanLayout(compact_len=14, placeholder_rows=(3, 8), span_lengths=(6, 4))  # expanded: 21 rows
RESPONSE = 5  # the last 5 compact rows are the generated response


@contextlib.contextmanager
def verl_router_replay_patch():
    """veRL's `apply_router_replay_patch()` for the block; every class it edits is restored afterwards."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig
    from verl.utils.megatron import router_replay_patch as rrp

    saved = [(cls, dict(cls.__dict__)) for cls in (TopKRouter, TransformerConfig, MoEAlltoAllTokenDispatcher)]
    instances = list(rrp.RouterReplay.router_instances)
    init = TransformerConfig.__init__
    signature = init.__dict__.get("__signature__")  # veRL rewrites it on the original function
    rrp.apply_router_replay_patch()
    try:
        yield rrp
    finally:
        for cls, attrs in saved:
            for name in set(cls.__dict__) - set(attrs):
                delattr(cls, name)
            for name in ("__init__", "routing", "preprocess"):
                if name in attrs:
                    setattr(cls, name, attrs[name])
        rrp.RouterReplay.router_instances[:] = instances
        if signature is None:
            init.__dict__.pop("__signature__", None)
        else:
            init.__signature__ = signature


def _model(modality: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from dsv4flash.integrations.mcore.router import with_modality_routing
    from tests.mcore_cpu.models import tiny_moe_config

    config = tiny_moe_config(num_moe_experts=E, moe_router_topk=K, moe_router_topk_scaling_factor=1.5,
                             enable_routing_replay=True)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    if modality:
        spec = with_modality_routing(spec)
    torch.manual_seed(3)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=S_VOCAB, max_sequence_length=64,
                     position_embedding_type="rope").eval()
    with torch.no_grad():
        for router in _routers(model):
            router.weight.normal_(0, 0.3)
            if modality:
                router.image_balance.expert_bias.copy_(torch.randn(E) * 0.5)
    return config, model


def _routers(model):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def _forward(model, ids, image_rows):
    from tests.mcore_cpu.models import causal_attention_mask

    seq = ids.shape[1]
    with contextlib.ExitStack() as stack, torch.no_grad():
        for router in _routers(model):
            stack.enter_context(router.modality_scope(image_rows.view(seq, 1)))  # [s, b]
        return model(ids, torch.arange(seq)[None], causal_attention_mask(seq))[0]  # [S, vocab]


def _nested(*tensors):
    return torch.nested.as_nested_tensor(list(tensors), layout=torch.jagged)


def test_text_only_r3_replay_is_exact(patch_form, mcore_parallel, monkeypatch):
    """Compact vLLM routes -> expanded replay: text rows replayed, image rows native, text log-probs identical."""
    from verl.utils.megatron import router_replay_utils as rru
    from verl.workers.engine.megatron import transformer_impl as ti

    # veRL fixes its device string at import ("cuda" when no accelerator is detected); keep the routes on CPU
    monkeypatch.setattr(rru, "device_name", "cpu")

    with verl_router_replay_patch() as rrp:
        config, model = _model(modality=True)
        image = LAYOUT.image_rows()
        ids = torch.randint(0, S_VOCAB, (1, LAYOUT.expanded_len), generator=torch.Generator().manual_seed(4))
        rrp.RouterReplay.set_global_router_replay_action(rrp.RouterReplayAction.RECORD)
        rollout = _forward(model, ids, image)
        routes_e = torch.stack([r.router_replay.get_recorded_indices() for r in _routers(model)], dim=1)  # [S, L, k]
        rrp.RouterReplay.clear_global_router_replay_action()
        # what vLLM returns: compact rows (placeholders carry routes of no use), none for the final token
        compact = routes_e[LAYOUT.expanded_rows()].clone()
        compact[~LAYOUT.compact_text_rows()] = E - 1
        compact = compact[:-1]
        # the trainer after an expert-bias update: text selection bias moved, weights unchanged
        with torch.no_grad():
            for router in _routers(model):
                router.expert_bias.add_(torch.randn(E, generator=torch.Generator().manual_seed(5)) * 3.0)
        drifted = _forward(model, ids, image)

        keys = r3_batch_keys([LAYOUT], [compact.shape[0]])
        input_ids = _nested(ids[0])
        batch = {"input_ids": input_ids, "loss_mask": _nested(torch.ones(LAYOUT.expanded_len)),
                 "multi_modal_inputs": [], **keys}
        inputs = ti.MegatronEngineWithLMHead.prepare_model_inputs(None, batch)
        row_map, native = inputs.get("r3_row_map", keys["r3_row_map"]), inputs.get("r3_native_rows", keys["r3_native_rows"])
        layers_topk_idx = ti.align_r3_router_replay_data(_nested(compact), input_ids, row_map=row_map)
        replay_mask = ti.build_r3_replay_mask(input_ids, torch.ones(1, RESPONSE), row_map=row_map, native_rows=native)
        rru.set_router_replay_data(layers_topk_idx, None, config, 0, replay_mask=replay_mask, model=model)
        rru.set_model_router_replay_action(model, rrp.RouterReplayAction.REPLAY_FORWARD)
        replayed = _forward(model, ids, image)
        rrp.RouterReplay.clear_global_router_replay_action()
        # the same machinery replaying *every* text row (a recording that includes the final token)
        full_keys = r3_batch_keys([LAYOUT], [LAYOUT.compact_len])
        full_routes = routes_e[LAYOUT.expanded_rows()]
        aligned = ti.align_r3_router_replay_data(_nested(full_routes), input_ids, row_map=full_keys["r3_row_map"])
        rru.set_router_replay_data(aligned, None, config, 0, replay_mask=_nested(~image), model=model)
        rru.set_model_router_replay_action(model, rrp.RouterReplayAction.REPLAY_FORWARD)
        replayed_all = _forward(model, ids, image)
        rrp.RouterReplay.clear_global_router_replay_action()

    text = ~image
    text[-1] = False  # R3 leaves the final row native: its logits predict past the sequence and are unused
    lp = lambda x: torch.log_softmax(x.float(), -1)  # noqa: E731
    mismatch = (lp(replayed) - lp(rollout))[text].abs().max().item()
    exact = (lp(replayed_all) - lp(rollout))[~image].abs().max().item()
    drift = (lp(drifted) - lp(rollout))[text].abs().max().item()
    assert drift > 1e-4, "the bias update must change text routing, or the test proves nothing"
    assert exact == 0.0, f"text log-prob mismatch {exact} with every text row replayed"
    # R3 leaves the final row native; its (drifted) expert choice only changes other rows' expert GEMM batch
    # shapes, i.e. fp32 rounding, never a route
    assert mismatch <= 2e-6, f"text log-prob mismatch {mismatch} after text-only R3 replay"
    mask = torch.cat(list(replay_mask.unbind()))
    assert not mask[image].any() and not mask[-1] and mask[text].all()
    patch_form.record("exact", exact)
    patch_form.record("mask", mask)


def test_stock_forward_step_calls_read_the_micro_batch_keys(mcore_parallel):
    """veRL 0.9.1's forward_step calls the two functions positionally: the twin reads the stashed keys."""
    from verl.workers.engine.megatron import transformer_impl as ti

    from tests.vllm._twins import applied

    compact = torch.arange((LAYOUT.compact_len - 1) * 2 * K).reshape(-1, 2, K)
    keys = r3_batch_keys([LAYOUT], [compact.shape[0]])
    input_ids = _nested(torch.zeros(LAYOUT.expanded_len, dtype=torch.long))
    batch = {"input_ids": input_ids, "loss_mask": _nested(torch.ones(LAYOUT.expanded_len)), "multi_modal_inputs": [],
             **keys}
    with applied(PATCH_ID):
        ti.MegatronEngineWithLMHead.prepare_model_inputs(None, batch)
        positional = ti.align_r3_router_replay_data(_nested(compact), input_ids)
        with pytest.raises(RuntimeError, match="route rows"):  # another micro-batch's ids never see this stash
            ti.align_r3_router_replay_data(_nested(compact), _nested(torch.zeros(LAYOUT.expanded_len, dtype=torch.long)))
        explicit = ti.align_r3_router_replay_data(_nested(compact), input_ids, row_map=keys["r3_row_map"])
        mask = ti.build_r3_replay_mask(input_ids, torch.ones(1, RESPONSE))
        ti.MegatronEngineWithLMHead.prepare_model_inputs(None, {k: batch[k] for k in ("input_ids", "loss_mask",
                                                                                   "multi_modal_inputs")})
        with pytest.raises(RuntimeError, match="route rows"):  # no keys: veRL's own alignment again
            ti.align_r3_router_replay_data(_nested(compact), input_ids)
    torch.testing.assert_close(positional.values(), explicit.values(), rtol=0, atol=0)
    rows = positional.unbind()[0]
    assert (rows[LAYOUT.image_rows()] == 0).all()
    torch.testing.assert_close(rows[LAYOUT.expanded_rows()[:-1][LAYOUT.compact_text_rows()[:-1]]],
                               compact[LAYOUT.compact_text_rows()[:-1]], rtol=0, atol=0)
    assert not mask.values()[LAYOUT.image_rows()].any()


def test_stock_r3_cannot_align_compact_routes(mcore_parallel):
    """Without the patch veRL refuses the compact recording (rows do not line up with the expanded inputs)."""
    from verl.workers.engine.megatron import transformer_impl as ti

    compact = torch.zeros(LAYOUT.compact_len - 1, 2, K, dtype=torch.long)
    with stock(PATCH_ID):
        ti.MegatronEngineWithLMHead.prepare_model_inputs(None, {
            "input_ids": _nested(torch.zeros(LAYOUT.expanded_len, dtype=torch.long)),
            "loss_mask": _nested(torch.ones(LAYOUT.expanded_len)), "multi_modal_inputs": []})
        with pytest.raises(RuntimeError, match="route rows"):
            ti.align_r3_router_replay_data(_nested(compact), _nested(torch.zeros(LAYOUT.expanded_len)))


def test_verl_replay_patch_breaks_the_stock_sqrtsoftplus_router(mcore_parallel):
    """docs/upstream.md §4.2: under veRL's replay patch megatron-core 0.19.2's own TopKRouter rejects sqrtsoftplus."""
    with verl_router_replay_patch():
        _, model = _model(modality=False)
        with pytest.raises(ValueError, match="sqrtsoftplus"):
            _forward_stock(model)


def _forward_stock(model):
    from tests.mcore_cpu.models import causal_attention_mask

    ids = torch.randint(0, S_VOCAB, (1, 8))
    with torch.no_grad():
        return model(ids, torch.arange(8)[None], causal_attention_mask(8))
