"""The serving math on CUDA: same numbers as on CPU, and capturable in a CUDA graph (no host sync)."""

from __future__ import annotations

import pytest
import torch

from dsv4flash.lora.serving import SlotStacks, o_proj_lora_delta, slot_grouped_lora_delta, slot_lora_delta
from dsv4flash.lora.serving.rope import cos_sin_cache

pytestmark = pytest.mark.gpu


def _stacks(slots=3, groups=8, rank=16, in_g=4096, out_g=1024, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return SlotStacks(torch.randn(slots, groups, rank, in_g, generator=gen) * 0.02,
                      torch.randn(slots, groups, out_g, rank, generator=gen) * 0.02)


def test_grouped_delta_matches_cpu():
    stacks = _stacks()
    o = torch.randn(37, 8, 4096)
    slots = torch.randint(-1, 3, (37,))
    cpu = slot_grouped_lora_delta(o, slots, stacks)
    gpu = slot_grouped_lora_delta(o.cuda(), slots.cuda(), SlotStacks(stacks.a.cuda(), stacks.b.cuda()))
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-4)


def test_o_proj_delta_replays_in_a_cuda_graph():
    """Static buffers, slots changed between replays: the graph follows the slots (no captured host values)."""
    stacks = SlotStacks(*(t.cuda() for t in (_stacks().a, _stacks().b)))
    cache = cos_sin_cache(1.0 / (10000 ** (torch.arange(0, 64, 2) / 64)), 4096).cuda()
    attn_out = torch.randn(64, 64, 512, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(64, device="cuda")
    slots = torch.zeros(64, dtype=torch.long, device="cuda")
    for _ in range(2):  # warm-up outside the graph, on a side stream as CUDA graphs require
        o_proj_lora_delta(attn_out, positions, cache, 64, 8, slots, stacks)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = o_proj_lora_delta(attn_out, positions, cache, 64, 8, slots, stacks)
    for fill in (0, 2, -1):
        slots.fill_(fill)
        graph.replay()
        torch.testing.assert_close(out, o_proj_lora_delta(attn_out, positions, cache, 64, 8, slots, stacks))


def test_plain_delta_matches_cpu():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 8, 2048, generator=gen), torch.randn(2, 1024, 8, generator=gen)
    x, slots = torch.randn(19, 2048, generator=gen), torch.randint(-1, 2, (19,), generator=gen)
    cpu = slot_lora_delta(x, slots, SlotStacks(a, b))
    torch.testing.assert_close(slot_lora_delta(x.cuda(), slots.cuda(), SlotStacks(a.cuda(), b.cuda())).cpu(), cpu,
                               rtol=1e-4, atol=1e-3)
