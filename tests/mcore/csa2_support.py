"""Shared pieces of the CSA2 Megatron tests: the reference oracle, builders and gradient comparison."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from tests._threads import single_thread  # noqa: F401  (the CSA2 tests use it as sup.single_thread)

VOCAB = 512


def reference(seed: int = 0):
    """The tiny reference model (fp32) — the parity oracle."""
    from dsv4flash.model.transformer import Transformer

    return Transformer("tiny", seed=seed)


def megatron_from(ref, **provider_kwargs: Any):
    """A `DSV41MegatronModel` built by the provider and loaded with the reference weights (train mode)."""
    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state

    model = DSV41ModelProvider(ref.cfg, **provider_kwargs).provide()
    load_reference_state(model, ref.state_dict())
    return model.train()


def token_ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Random token ids [batch, seq]."""
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def probe(shape, seed: int) -> torch.Tensor:
    """A fixed random cotangent: loss = Σ logits · probe touches every logit with a distinct weight."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def grad_pairs(ref, model) -> Iterator[tuple[str, torch.Tensor | None, torch.Tensor | None]]:
    """(Megatron name, reference grad in Megatron layout, Megatron grad) for every mapped parameter."""
    from dsv4flash.integrations.mcore.csa2 import name_map

    ref_params = dict(ref.named_parameters())
    params = dict(model.named_parameters())
    for pair in name_map(ref.cfg):
        if pair.megatron not in params:  # buffers (router expert biases)
            continue
        grads = [ref_params[name].grad for name in pair.reference]
        ref_grad = None if any(g is None for g in grads) else torch.cat(grads) if len(grads) > 1 else grads[0]
        yield pair.megatron, ref_grad, params[pair.megatron].grad


def assert_grads_match(ref, model, rel: float = 2e-4, reduce=None) -> int:
    """Every Megatron grad equals the reference's within `rel`·max|g| (None only where the reference has None)."""
    checked = 0
    for name, expected, got in grad_pairs(ref, model):
        if got is not None and reduce is not None:
            got = reduce(got.clone())
        if expected is None:
            assert got is None or not bool(got.any()), f"{name}: the reference has no gradient, Megatron has one"
            continue
        assert got is not None, f"{name}: no Megatron gradient"
        scale = float(expected.abs().max())
        err = float((got - expected).abs().max())
        assert err <= rel * scale + 1e-7, f"{name}: max |Δgrad| {err:.3g} vs max |grad| {scale:.3g}"
        checked += 1
    return checked


def assert_ep_grads(ref, model, want_grads: dict[str, torch.Tensor], rank: int, world_size: int) -> None:
    """EP rank `rank` of `world_size`, both ranks fed the same batch: a local expert's grad is twice the
    reference's (its tokens arrive from both ranks), every other grad equals the reference's."""
    from dsv4flash.integrations.mcore.csa2 import name_map

    params = dict(model.named_parameters())
    local = ref.cfg.text.n_routed_experts // world_size
    for pair in name_map(ref.cfg):
        want = want_grads.get(pair.megatron)
        if want is None or pair.megatron not in params and pair.expert is None:
            continue
        name = pair.megatron
        if pair.expert is not None:
            if pair.expert // local != rank:
                continue
            name = name.replace(f"local_experts.{pair.expert}.", f"local_experts.{pair.expert % local}.")
            want = 2 * want
        got = params[name].grad
        err, scale = float((got - want).abs().max()), float(want.abs().max())
        assert err <= 5e-4 * scale + 1e-7, f"rank {rank} {name}: |Δgrad| {err:.3g} vs {scale:.3g}"


def reference_grads(ref) -> dict[str, torch.Tensor]:
    """Every reference gradient in Megatron layout under its Megatron name (tensors without one left out)."""
    from dsv4flash.integrations.mcore.csa2 import name_map

    params = dict(ref.named_parameters())
    grads = {}
    for pair in name_map(ref.cfg):
        parts = [params[n].grad if n in params else None for n in pair.reference]
        if all(p is not None for p in parts):
            grads[pair.megatron] = torch.cat(parts) if len(parts) > 1 else parts[0]
    return grads


def save_reference_expectation(path, ids_seed: int, probe_seed: int) -> None:
    """Run the single-device reference on [2, 32] tokens with a probe loss and save what the ranks compare to:
    ids, probe weights, logits and every gradient under its Megatron parameter name."""
    ref = reference(seed=0)
    ids = token_ids(2, 32, seed=ids_seed)
    weights = probe((2, 32, VOCAB), seed=probe_seed)
    logits = ref(ids)
    (logits * weights).sum().backward()
    torch.save({"ids": ids, "weights": weights, "logits": logits.detach(), "grads": reference_grads(ref)}, path)


def pack(seqs, pads, pad_ids):
    """THD batch [1, T]: ids, per-sequence positions, PackedSeqParams and each sequence's slot start."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ids, pos, cu, cu_pad = [], [], [0], [0]
    for seq, pad, fill in zip(seqs, pads, pad_ids):
        ids += [seq, fill[:pad]]
        pos += [torch.arange(len(seq)), torch.zeros(pad, dtype=torch.long)]
        cu.append(cu[-1] + len(seq))
        cu_pad.append(cu_pad[-1] + len(seq) + pad)
    cu_t, cu_pad_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(cu_pad, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, cu_seqlens_q_padded=cu_pad_t,
                             cu_seqlens_kv_padded=cu_pad_t, max_seqlen_q=max(len(s) for s in seqs),
                             max_seqlen_kv=max(len(s) for s in seqs))
    return torch.cat(ids)[None], torch.cat(pos)[None], params, cu_pad[:-1]


def tiny_with_flash_plan():
    """Tiny widths with the release's 40-layer plan: kv sources 2/8/14/20, index sources every 4 layers
    from 20, the candidate source at 20 (first decoder layer), Engram at layers 1 and 14."""
    from dsv4flash.config import _derive_engram_layouts, load_config

    flash = load_config("flash").text
    n = flash.num_hidden_layers
    cfg = load_config("tiny").replace_text(
        num_hidden_layers=n, compress_ratios=flash.compress_ratios[:n], engram_layer_ids=flash.engram_layer_ids,
        kv_source_layer_ids=flash.kv_source_layer_ids, index_source_layer_ids=flash.index_source_layer_ids,
        candidate_source_layer_id=flash.candidate_source_layer_id)
    return cfg.replace_text(engram_num_embeddings=tuple(t.num_rows for t in _derive_engram_layouts(cfg.text)))


def reference_model(cfg, seed: int = 0):
    """The reference model (fp32) of any V4.1 config."""
    from dsv4flash.model.transformer import Transformer

    return Transformer(cfg, seed=seed)
