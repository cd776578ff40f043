"""Backward stops at the first trainable block; the CED source's KV stays the base's under freeze_kv_write."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv4flash.lora import LoraConfig, apply_lora, first_trainable_layer, forward_with_early_stop, lora_parameters
from dsv4flash.model.state import CSA2State

from .conftest import randomize_adapters


@pytest.mark.parametrize("preset, layers, expected", [
    ("decoder_half", None, "ds"), ("full_linear", None, 0), ("encoder_half", None, 0), ("vit_lr_0p1", None, 0),
    ("full_linear", "9-11", 9),
])
def test_first_trainable_layer(make_model, tiny_cfg, preset, layers, expected):
    model = make_model()
    assert first_trainable_layer(model) == 0  # a fresh model trains everything
    apply_lora(model, LoraConfig(preset=preset, layers=layers))
    assert first_trainable_layer(model) == (tiny_cfg.decoder_start if expected == "ds" else expected)


class EncoderWork:
    """Counts activations saved for backward and backward nodes executed inside the encoder blocks."""

    def __init__(self, model, n_encoder):
        self.saved = self.backward_nodes = 0
        self.inside = False
        self.handles = []
        for block in model.layers[:n_encoder]:
            self.handles.append(block.register_forward_pre_hook(self._enter))
            self.handles.append(block.register_forward_hook(self._leave))

    def _enter(self, module, args):
        self.inside = True

    def _leave(self, module, args, output):
        self.inside = False
        streams = output[0]
        if streams.grad_fn is not None:
            streams.grad_fn.register_prehook(self._ran)

    def _ran(self, grad_outputs):
        self.backward_nodes += 1

    def pack(self, t):
        self.saved += int(self.inside)
        return t

    def close(self):
        for h in self.handles:
            h.remove()


def _run(model, fn, ids, types=None, images=None):
    work = EncoderWork(model, model.cfg.decoder_start)
    for p in lora_parameters(model).values():
        p.grad = None
    with torch.autograd.graph.saved_tensors_hooks(work.pack, lambda t: t):
        logits = fn(model, ids, types, images)
    targets = ids.roll(-1, dims=1)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    work.close()
    grads = {k: p.grad.clone() for k, p in lora_parameters(model).items()}
    return logits.detach(), grads, work


def _plain(model, ids, types, images):
    return model(ids, types, images)


def test_early_stop_runs_no_encoder_autograd_and_matches_the_plain_forward(make_model, ids):
    model = make_model()
    apply_lora(model, "decoder_half")
    randomize_adapters(model)
    # PEFT's enable_input_require_grads (needed by reentrant activation checkpointing) makes the embedding
    # output require grad, so a plain forward builds and runs the whole encoder graph.
    model.embed.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    logits_p, grads_p, plain = _run(model, _plain, ids)
    logits_e, grads_e, early = _run(model, forward_with_early_stop, ids)
    assert plain.saved > 0 and plain.backward_nodes > 0  # the probe sees encoder autograd when it exists
    assert early.saved == 0 and early.backward_nodes == 0
    assert torch.equal(logits_e, logits_p)
    assert grads_e.keys() == grads_p.keys() and all(torch.equal(grads_e[k], grads_p[k]) for k in grads_p)
    assert all(g.abs().sum() > 0 for k, g in grads_e.items())  # every decoder adapter does learn


def test_early_stop_with_a_frozen_vit_and_images(make_model, vl_batch):
    ids, types, images = vl_batch
    model = make_model()
    apply_lora(model, "decoder_half")
    randomize_adapters(model)
    logits_p, grads_p, _ = _run(model, _plain, ids, types, images)
    logits_e, grads_e, early = _run(model, forward_with_early_stop, ids, types, images)
    assert early.saved == 0 and early.backward_nodes == 0
    assert torch.equal(logits_e, logits_p)
    assert all(torch.equal(grads_e[k], grads_p[k]) for k in grads_p)


def test_trained_vit_keeps_the_full_backward(make_model, vl_batch):
    ids, types, images = vl_batch
    model = make_model()
    apply_lora(model, "vit_lr_0p1")
    randomize_adapters(model)
    logits_e, grads_e, early = _run(model, forward_with_early_stop, ids, types, images)
    assert early.saved > 0 and early.backward_nodes > 0
    assert grads_e["vision.blocks.0.attn.wqkv.lora_A.weight"].abs().sum() > 0


def _ced_kv(model, ids):
    """What the CED source layer writes: its window KV (kv_norm output) and the published compressed state."""
    ds = model.cfg.decoder_start
    seen = {}
    hook = model.layers[ds].attn.kv_norm.register_forward_hook(lambda m, a, out: seen.setdefault("window_kv", out))
    with torch.no_grad():
        streams, pre_mix, ctx = model.embed_inputs(ids)
        _, _, state = model.run_layers(streams, pre_mix, CSA2State(), ctx, 0, ds + 1)
    hook.remove()
    return seen["window_kv"], state


def test_freeze_kv_write_keeps_the_ced_source_kv_of_the_base(make_model, ids):
    base_kv, base_state = _ced_kv(make_model(), ids)
    shared = make_model()
    apply_lora(shared, "decoder_half")
    randomize_adapters(shared)
    kv, state = _ced_kv(shared, ids)
    assert torch.equal(kv, base_kv)
    assert torch.equal(state.compress_kv, base_state.compress_kv) and torch.equal(state.index_k, base_state.index_k)
    # Control: without the freeze, the CED source's compressor adapter changes the shared compressed KV.
    own = make_model()
    apply_lora(own, LoraConfig(preset="decoder_half", freeze_kv_write=False))
    randomize_adapters(own)
    kv, state = _ced_kv(own, ids)
    assert not torch.equal(state.compress_kv, base_state.compress_kv) and not torch.equal(kv, base_kv)
