"""What crosses a pipeline-stage boundary of the CSA2 stack: the streams *and* the cross-layer state.

megatron-core 0.19's 1F1B schedule ships one tensor per micro-batch between stages. A V4.1 stage boundary
has to carry the packed mHC streams, the lagged collapse weights `pre_mix` and the four `CSA2State`
tensors (compressed KV and index keys of the latest kv source, top-k of the latest index source, the
candidate pool), because a Reuse layer on the next stage reads what a Full layer on this one published and
the kv source's compressor is trained through it. `encode` flattens all of it into one fp32 tensor
[N, 1, 1] (the schedule's `variable_seq_lengths` mode exchanges its shape first); `decode` splits the
received tensor back into views, so the gradient the next stage sends back reaches every part: the
streams, `pre_mix` and the compressed KV (the kv-source compressor's gradient from readers downstream).
Index keys, top-k and candidates carry no gradient (they only feed discrete selections).

Layout: a header of small integers (fp32, exact), then the parts in a fixed order. Integers (top-k ids,
the candidate mask) are exact in fp32 up to 2^24; the payload is fp32 whatever the activation dtype, so
bf16 streams are carried exactly and fp32 islands (`pre_mix`) keep their precision.
"""

from __future__ import annotations

from typing import Optional

import torch

from dsv4flash.integrations.mcore.csa2.carry import CSA2Context, CSA2Tokens
from dsv4flash.model.state import CSA2State

__all__ = ["PAYLOAD_DTYPE", "encode", "decode"]

PAYLOAD_DTYPE = torch.float32
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool)
_PARTS = 6  # streams, pre_mix, compress_kv, index_k, topk, candidates
_HEADER = 4 + _PARTS * 4  # CSA2State.meta() + per part (dtype code or −1, three dims)


def encode(streams: torch.Tensor, ctx: CSA2Context) -> torch.Tensor:
    """streams [s, b, hc·D] + context -> one fp32 payload [N, 1, 1] (differentiable in every float part)."""
    parts = (streams, ctx.pre_mix, *ctx.state.tensors())
    header = list(ctx.state.meta())
    flat = []
    for part in parts:
        if part is None:
            header += [-1, 0, 0, 0]
            continue
        if part.dim() != 3:
            raise ValueError(f"pipeline payload: expected 3-d parts, got {list(part.shape)}")
        header += [_DTYPES.index(part.dtype), *part.shape]
        flat.append(part.reshape(-1).to(PAYLOAD_DTYPE))
    head = torch.tensor(header, dtype=PAYLOAD_DTYPE, device=streams.device)
    return torch.cat([head, *flat]).view(-1, 1, 1)


def decode(payload: torch.Tensor, tokens: CSA2Tokens) -> tuple[torch.Tensor, CSA2Context]:
    """Inverse of `encode`: views of the received payload (gradients flow back into it)."""
    flat = payload.reshape(-1)
    if flat.numel() < _HEADER:
        raise ValueError(f"pipeline payload of {flat.numel()} values is shorter than its {_HEADER}-value header "
                         "(was the previous stage built with the CSA2 stack?)")
    header = [int(v) for v in flat[:_HEADER].detach().tolist()]
    meta, offset = tuple(header[:4]), _HEADER
    parts: list[Optional[torch.Tensor]] = []
    for i in range(_PARTS):
        code, *shape = header[4 + 4 * i: 8 + 4 * i]
        if code < 0:
            parts.append(None)
            continue
        n = shape[0] * shape[1] * shape[2]
        if offset + n > flat.numel():
            raise ValueError(f"pipeline payload: part {i} needs {n} values past {offset}, only {flat.numel()} sent")
        value = flat[offset:offset + n].view(shape)
        dtype = _DTYPES[code]
        if dtype == torch.bool:
            value = value.detach() > 0.5
        elif dtype == torch.int64:
            value = value.detach().round().to(torch.int64)
        elif i == 3:  # index keys: out of the graph, as at their producer
            value = value.detach().to(dtype)
        else:
            value = value.to(dtype)
        parts.append(value)
        offset += n
    if offset != flat.numel():
        raise ValueError(f"pipeline payload: {flat.numel() - offset} values left over after the header's parts")
    streams, pre_mix, *state = parts
    if streams is None or pre_mix is None:
        raise ValueError("pipeline payload carries no streams / pre_mix")
    return streams, CSA2Context(pre_mix=pre_mix, state=CSA2State.from_parts(tuple(state), meta), tokens=tokens)
