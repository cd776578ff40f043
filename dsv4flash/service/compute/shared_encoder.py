"""Shared-encoder multi-adapter scoring: encoder half + the CED source's compressed KV once, decoder per adapter.

A decoder-only adapter (layers ≥ `cfg.decoder_start`) whose KV write is frozen (`freeze_kv_write`: no LoRA on
layer decoder_start's `attn.wkv` and compressor) sees exactly the base's encoder output and the base's
compressed KV. So for one prompt batch we run `embed_inputs` + `run_layers(0, decoder_start)` once, compute
the source compressor's latent once, and run only `run_layers(decoder_start, end)` + `logits` per adapter.
Every op sees the same shapes and values as the separate full forward, so the logits are bit-equal. Adapters
of one placement run those decoder halves as one batched pass whose batch-dependent ops run per adapter chunk
(`batched_decoder.py`, `batch_invariant.py`), still bit-equal. An adapter that is not decoder-only, or whose
KV write trains, is refused for sharing (with the reason) and run separately.

With `caches=True` each adapter also gets its prompt's `DecodeCache` for incremental decode: the encoder
half's window KV and every kv-source segment (the encoder's and the CED source's) are one set of tensors
referenced by every shared adapter's cache; each adapter owns only its decoder layers' window KV.
`multi_adapter_decode` extends such caches a step at a time, running the encoder half once per distinct
continuation (the same ids from the same shared encoder records), so the sharing lasts past the prompt.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from dsv4flash.lora.layers import is_lora_module
from dsv4flash.model.cache import CacheStep, DecodeCache
from dsv4flash.model.decode import empty_cache
from dsv4flash.model.state import CSA2State
from dsv4flash.service.compute.batch_invariant import instance_override
from dsv4flash.engine.device import on_device
from dsv4flash.service.compute.batched_decoder import batched_decoder_logits
from dsv4flash.engine.resident import placement_key


def sharing_refusal(resident, placement) -> str | None:
    """Why `placement` cannot share the encoder (None if it can)."""
    from dsv4flash.lora import get_handle

    if resident.device.type != "cpu":
        return (f"the resident base computes on {resident.device}: the shared encoder pass runs on the CPU only "
                "(each adapter prefills on its own)")
    start = resident.cfg.decoder_start
    handle = get_handle(resident.shell(placement))
    early = [l for l in handle.layers() if l < start]
    if early:
        return (f"adapter is not decoder-only: it has LoRA on encoder layers {list(early)} "
                f"(decoder_start = {start}; preset {placement.preset!r}, layers={placement.layers!r})")
    if not placement.freeze_kv_write:
        return (f"adapter trains the KV write of layer {start} (freeze_kv_write=False): its compressed KV differs "
                f"from the base's, so it cannot share it")
    return None


@dataclass
class MultiAdapterResult:
    """Logits per adapter ([B,S,V] fp32, in input order) and which adapters were refused sharing, and why."""

    logits: list[torch.Tensor]
    refused: dict[int, str] = field(default_factory=dict)
    shared: list[int] = field(default_factory=list)
    batched: list[int] = field(default_factory=list)  # adapters whose decoder halves ran as one batched pass
    compressor_reuses: int = 0  # adapters that took the source compressor's latent from the shared pass
    caches: list[DecodeCache | None] = field(default_factory=list)  # caches=True: each adapter's prompt cache


def _same_args(args: tuple, seen: tuple) -> bool:
    """Positional args equal to a memo entry's: the same object, or a tensor with the same shape and bits."""
    if len(args) != len(seen):
        return False
    for a, b in zip(args, seen):
        if a is b:
            continue
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            if a != b:
                return False
        elif a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            return False
    return True


def _memoize(owner, method: str, entries: list, stats: Counter, stat: str):
    """owner.<method>(*args) returns the result of an earlier call with bit-equal args (two entries kept)."""
    original = getattr(type(owner), method)

    def call(*args, **kwargs):
        if not kwargs:
            for seen, out in entries:
                if _same_args(args, seen):
                    stats[stat] += 1
                    return out
        out = original(owner, *args, **kwargs)
        entries.insert(0, (args, out))
        del entries[2:]  # hc runs twice per block (attention and FFN site): keep both
        return out

    return call


@contextmanager
def _shared_prefix(model, memo: dict, stats: Counter):
    """Layer decoder_start's work before its first LoRA op is done once for all adapters of the batch.

    For a decoder-only adapter with the KV write frozen, the attention-site hyper-connection, `attn_norm`, the
    KV projection `wkv` / `kv_norm`, the source compressor and its index keys all see the shared encoder output
    and base weights only; each is memoised on bit-equal inputs (the chain mostly hits on object identity).
    """
    block = model.layers[model.cfg.decoder_start]
    attn = block.attn
    sites = [(block.hc, "forward", "hc"), (block.attn_norm, "forward", "norm"),
             (attn.wkv, "forward", "kv"), (attn.kv_norm, "forward", "kv")]
    if attn.compressor is not None:
        sites.append((attn.compressor, "forward", "compressor"))
    if attn.indexer is not None and attn.compressor is not None:
        sites.append((attn.indexer, "index_keys", "index_keys"))
    with ExitStack() as stack:
        for owner, method, stat in sites:
            if not is_lora_module(owner):  # an adapted op is never shared
                entries = memo.setdefault((id(owner), method), [])  # kept across the adapters of one call
                stack.enter_context(instance_override(owner, method, _memoize(owner, method, entries, stats, stat)))
        yield


def encoder_half(base, input_ids: torch.Tensor, past: DecodeCache | None):
    """Embed + layers < decoder_start on the base, once -> ((streams, pre_mix, state, context), the CacheStep
    holding the encoder layers' records over `past`, or None without a cache)."""
    history = None if past is None else (past.ngram_ids, past.ngram_types)
    streams, pre_mix, ctx = base.embed_inputs(input_ids, history=history)  # [B,S,hc,D]
    step = None
    if past is not None:
        step = CacheStep(past)
        ctx = dataclasses.replace(ctx, cache=step)  # records the encoder half's KV once
    return base.run_layers(streams, pre_mix, CSA2State(), ctx, 0, base.cfg.decoder_start) + (ctx,), step


def decoder_half(model, enc: tuple, step: CacheStep | None, memo: dict, stats: Counter) -> torch.Tensor:
    """Layers ≥ decoder_start + head of one bound adapter over the shared encoder output -> logits [B,S,V]."""
    streams, pre_mix, state, ctx = enc
    with _shared_prefix(model, memo, stats):
        streams, pre_mix, _ = model.run_layers(streams, pre_mix, state, dataclasses.replace(ctx, cache=step),
                                               model.cfg.decoder_start, None)
    return model.logits(streams, pre_mix)


def _share_source_segments(caches: list[DecodeCache], layer: int) -> list[DecodeCache]:
    """Caches whose `layer` segment is bit-equal to the first's reference the first's tensors instead."""
    first = caches[0].sources[layer]
    out = [caches[0]]
    for cache in caches[1:]:
        seg = cache.sources[layer]
        if all(torch.equal(a, b) for a, b in zip(seg.tensors(), first.tensors())):
            cache = dataclasses.replace(cache, sources={**cache.sources, layer: first})
        out.append(cache)
    return out


@torch.no_grad()
def multi_adapter_logits(resident, input_ids: torch.Tensor, adapters: list[tuple], share: bool = True,
                         exact: bool = True, caches: bool = False, batched: bool = True) -> MultiAdapterResult:
    """input_ids [B,S]; adapters: [(placement, tensors)] -> logits per adapter (shared encoder where allowed).

    Shared adapters of one placement run their decoder halves as one batched pass (`batched_decoder.py`). With
    `exact` (default) the ops whose rounding depends on the batch run per adapter chunk (`batch_invariant.py`)
    and the logits are bit-equal to separate runs; `exact=False` batches those too, equal to fp32 rounding
    only. `batched=False`: one decoder pass per shared adapter, bit-equal as well. `caches`: also return each
    adapter's prompt DecodeCache (exact only).
    """
    if caches and not exact:
        raise ValueError("multi_adapter_logits: caches=True needs exact=True (a cache must equal the adapter's own "
                         "prefill bit for bit)")
    result = MultiAdapterResult([None] * len(adapters), caches=[None] * len(adapters))
    start = resident.cfg.decoder_start
    with resident.lock:
        if share:
            for i, (pc, _) in enumerate(adapters):
                reason = sharing_refusal(resident, pc)
                if reason is None:
                    result.shared.append(i)
                else:
                    result.refused[i] = reason
        enc = None
        memo: dict = {}
        stats: Counter = Counter()  # reuses per shared op
        enc_step = None
        if result.shared:
            past = empty_cache(resident.model, input_ids.shape[0], input_ids.device) if caches else None
            enc, enc_step = encoder_half(resident.model, input_ids, past)
        groups: dict[str, list[int]] = {}
        if batched:
            for i in result.shared:
                groups.setdefault(placement_key(adapters[i][0]), []).append(i)
        for members in groups.values():
            if len(members) < 2:
                continue
            pc = adapters[members[0]][0]
            steps = [enc_step.fork() for _ in members] if enc_step is not None else None  # each its own records
            with resident.bind(pc, adapters[members[0]][1]) as model:
                logits = batched_decoder_logits(model, resident.adapter_slots(pc), [adapters[i][1] for i in members],
                                                enc, stats, invariant=exact, steps=steps)
            for k, (i, lg) in enumerate(zip(members, logits)):
                result.logits[i] = lg
                if steps is not None:
                    result.caches[i] = steps[k].finish(input_ids, torch.full_like(input_ids, -1))
            result.batched.extend(members)
        for i, (pc, tensors) in enumerate(adapters):
            if result.logits[i] is not None:
                continue
            with resident.bind(pc, tensors) as model:
                if i in result.shared:
                    step = enc_step.fork() if enc_step is not None else None  # the encoder's records, shared
                    result.logits[i] = decoder_half(model, enc, step, memo, stats)  # [B,S,V]
                    if step is not None:
                        result.caches[i] = step.finish(input_ids, torch.full_like(input_ids, -1))
                elif caches:  # refused: the adapter's own prefill, wherever the base computes (CPU tensors out)
                    result.logits[i], result.caches[i] = on_device(model, resident.device).prefill(input_ids)
                else:
                    result.logits[i] = on_device(model, resident.device)(input_ids)
    if caches and len(result.shared) > 1 and start in resident.model.cfg.text.kv_source_layer_ids:
        shared = _share_source_segments([result.caches[i] for i in result.shared], start)
        for i, cache in zip(result.shared, shared):
            result.caches[i] = cache
    result.compressor_reuses = stats["compressor"]
    return result


def _encoder_key(cache: DecodeCache, start: int) -> tuple:
    """What the encoder half of a decode step reads from `cache`: identical keys give identical encoder work."""
    return (cache.length, tuple(id(w) for w in cache.window[:start]),
            tuple(id(seg) for layer, seg in sorted(cache.sources.items()) if layer < start))


@dataclass
class MultiAdapterStep:
    """One decode step of N adapters: logits per adapter ([B,V] or [B,n,V] fp32), the extended caches, how
    many encoder-half passes ran (1 when every adapter shared one), and which decoder halves ran batched."""

    logits: list[torch.Tensor]
    caches: list[DecodeCache]
    encoder_passes: int = 0
    refused: dict[int, str] = field(default_factory=dict)
    batched: list[int] = field(default_factory=list)  # adapters whose decoder halves ran as one batched pass


@torch.no_grad()
def multi_adapter_decode(resident, caches: list[DecodeCache], next_ids: torch.Tensor | list[torch.Tensor],
                         adapters: list[tuple], batched: bool = True) -> MultiAdapterStep:
    """Decode one token (next_ids [B]) or chunk ([B,n]) for N adapters, each from its own cache; bit-equal to
    each adapter's own `model.decode(cache, next_ids)`.

    `next_ids` is one tensor for every adapter (teacher forcing: the same continuation scored under N
    adapters) or one per adapter. Decoder-only, KV-write-frozen adapters whose caches hold the same encoder
    records (forks of one shared prefill, `multi_adapter_logits(..., caches=True)`, kept shared by every
    step of this function) and that get the same ids run the encoder half once; each runs its own decoder
    half from its own decoder-layer cache. The shared encoder records stay one set of tensors in the new
    caches, so sharing continues for as long as the continuations agree; an adapter whose ids diverge is
    grouped on its own (still one encoder pass per distinct continuation). Other adapters decode alone.
    Members of one placement run their decoder halves as one bit-exact batched pass (`batched=False`: one
    pass each), each from its own cache.
    """
    if len(caches) != len(adapters):
        raise ValueError(f"multi_adapter_decode: {len(caches)} caches for {len(adapters)} adapters")
    ids = list(next_ids) if isinstance(next_ids, (list, tuple)) else [next_ids] * len(adapters)
    if len(ids) != len(adapters):
        raise ValueError(f"multi_adapter_decode: {len(ids)} next_ids for {len(adapters)} adapters")
    one_token = ids[0].ndim == 1
    ids = [t[:, None] if t.ndim == 1 else t for t in ids]  # [B, n]
    start = resident.cfg.decoder_start
    out = MultiAdapterStep([None] * len(adapters), [None] * len(adapters))
    groups: dict[tuple, list[int]] = {}
    with resident.lock:
        for i, (pc, _) in enumerate(adapters):
            reason = sharing_refusal(resident, pc)
            if reason is not None:
                out.refused[i] = reason
                continue
            key = _encoder_key(caches[i], start)
            for (k, leader), members in groups.items():  # same encoder records and the same ids
                if k == key and torch.equal(ids[leader], ids[i]) and torch.equal(
                        caches[leader].ngram_ids, caches[i].ngram_ids):
                    members.append(i)
                    break
            else:
                groups[(key, i)] = [i]
        memo: dict = {}
        stats: Counter = Counter()
        for (_, leader), members in groups.items():
            chunk = ids[leader]
            enc, enc_step = encoder_half(resident.model, chunk, caches[leader])
            out.encoder_passes += 1
            types = torch.full_like(chunk, -1)
            steps = {i: CacheStep(caches[i], dict(enc_step.window), dict(enc_step.sources)) for i in members}
            placements: dict[str, list[int]] = {}  # own decoder past each; same placement: one batched pass
            for i in members:
                placements.setdefault(placement_key(adapters[i][0]) if batched else str(i), []).append(i)
            for same in placements.values():
                if len(same) > 1:
                    pc = adapters[same[0]][0]
                    with resident.bind(pc, adapters[same[0]][1]) as model:
                        logits = batched_decoder_logits(model, resident.adapter_slots(pc),
                                                        [adapters[i][1] for i in same], enc, stats, invariant=True,
                                                        steps=[steps[i] for i in same])
                    for i, lg in zip(same, logits):
                        out.logits[i] = lg
                    out.batched.extend(same)
                    continue
                pc, tensors = adapters[same[0]]
                with resident.bind(pc, tensors) as model:
                    out.logits[same[0]] = decoder_half(model, enc, steps[same[0]], memo, stats)
            for i in members:
                out.caches[i] = steps[i].finish(chunk, types)
            if len(members) > 1 and start in resident.cfg.text.kv_source_layer_ids:
                for i, cache in zip(members, _share_source_segments([out.caches[i] for i in members], start)):
                    out.caches[i] = cache
        for i in out.refused:
            pc, tensors = adapters[i]
            with resident.bind(pc, tensors) as model:
                out.logits[i], out.caches[i] = model.decode(caches[i], ids[i])
    if one_token:
        out.logits = [lg[:, 0] for lg in out.logits]
    return out
