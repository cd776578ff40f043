"""`DSV41Bridge`: Megatron-Bridge's model bridge for DeepSeek-V4.1 (`DeepseekV41ForCausalLM`) on the plugin's
Megatron-Core model (`DSV41MegatronModel`, built by `DSV41ModelProvider`).

- **Names** come from the bridge's name table (`mappings.build_registry`), the same table the converter and
  the Megatron loader use.
- **Import** decodes each quantized release weight with the bridge codecs (`dsv4flash_bridge.codecs`): dense
  FP8 over **32×32** blocks (Megatron-Bridge's `maybe_dequantize_hf_quantized_weight` assumes 128 and would
  silently mis-decode), routed experts as MXFP4 (1×32, low nibble = even column), Engram rows per-row 1×32.
- **Export** re-encodes every quantized weight with the checkpoint's own scales as `like_scale`, so an
  unchanged weight comes back byte-identical and a changed block gets its canonical power-of-two scale;
  unquantized tensors are cast to their stored dtype. Engram tables (384 M rows at release size) leave in
  row chunks (`RowChunk`, `engram_rows_per_chunk` rows each, encoded chunk by chunk against the matching
  rows of the checkpoint's scales), so no tensor of a whole table's size is materialised on export, as on
  import; `save_release` writes the chunks in place. Re-encoding happens after LoRA merging (Megatron-Bridge
  merges after `maybe_modify_converted_hf_weight`, which would add a delta to FP8 bytes), so it is done on
  the exported stream instead; grouped `wo_a` adapters are merged there too.
- **Adapters**: `stream_adapter_weights_megatron_to_hf` adds the block-diagonal `wo_a` adapters
  (`grouped_lora.py`) to Megatron-Bridge's own; `peft_export.save_peft_adapter` writes them in the plugin's
  PEFT format.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator, List, Mapping, Optional, Union

import torch
from megatron.bridge.models.conversion.model_bridge import HFWeightTuple, MegatronModelBridge
from megatron.core import parallel_state

from dsv4flash.config import DSV41FlashConfig, load_config
from dsv4flash.integrations.mbridge.checkpoint import RowChunk
from dsv4flash.release.quant_plan import QuantRole, quant_role, scale_name
from dsv4flash_bridge import codecs
from dsv4flash_bridge.mapping import megatron_lookup

__all__ = ["DSV41Bridge", "SOURCE", "MODEL_TYPE"]

SOURCE = "DeepseekV41ForCausalLM"
MODEL_TYPE = "deepseek_v41"
_QUANTIZED = (QuantRole.DENSE_FP8, QuantRole.EXPERT_MXFP4, QuantRole.ENGRAM_FP8)
_WIDE_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class DSV41Bridge(MegatronModelBridge):
    """HF-layout (release) V4.1 checkpoint <-> `DSV41MegatronModel`; registered by `register()`."""

    decode_dtype: torch.dtype = torch.float32  # exact for every valid stored tensor
    engram_rows_per_chunk: int = 1 << 16  # Engram rows per import read and per export chunk

    # ---- model -----------------------------------------------------------------------------------------
    def provider_bridge(self, hf_pretrained):
        """A Megatron-Bridge provider (`DSV41BridgeModelProvider`) for the checkpoint's `config.json`."""
        from dsv4flash.integrations.mbridge.provider import DSV41BridgeModelProvider

        return DSV41BridgeModelProvider(release_config(hf_pretrained))

    @classmethod
    def megatron_to_hf_config(cls, provider) -> dict:
        """The release `config.json` dict of a provider's V4.1 config."""
        return provider.dsv4.to_hf()

    def mapping_registry(self):
        """Every rule of the name table as a Megatron-Bridge mapping."""
        from dsv4flash.integrations.mbridge.mappings import build_registry

        return build_registry()

    # ---- import ----------------------------------------------------------------------------------------
    def maybe_modify_loaded_hf_weight(self, hf_param: Union[str, Mapping[str, str]], hf_state_dict):
        """Read the release tensor(s) of a mapping, decoding quantized ones with their `.scale`."""
        if isinstance(hf_param, str):
            return self._load(hf_param, hf_state_dict)
        return {key: self._load(name, hf_state_dict) for key, name in hf_param.items()}

    def load_weights_hf_to_megatron(self, hf_pretrained, megatron_model, allowed_mismatched_params=None):
        """Megatron-Bridge's load, then the host-pinned Engram tables it cannot see (they are not parameters)."""
        from megatron.core.utils import unwrap_model

        models = super().load_weights_hf_to_megatron(hf_pretrained, megatron_model, allowed_mismatched_params)
        for model in unwrap_model(models if isinstance(models, list) else [models]):
            for prefix, table in _host_tables(model).items():
                _fill_table(table, megatron_lookup(prefix + ".embed.weight").release[0], hf_pretrained.state,
                            self.engram_rows_per_chunk)
        return models

    def _load(self, name: str, hf_state_dict) -> torch.Tensor:
        role = quant_role(name)
        # A dequantized checkpoint (a dsv4flash base, a BF16 conversion) stores these in a wide float dtype
        # and carries no `.scale`: it is read as is.
        if role not in _QUANTIZED or _stored_dtype(name, hf_state_dict) in _WIDE_FLOATS:
            return hf_state_dict[name]
        q, s = hf_state_dict[name], hf_state_dict[scale_name(name)]
        return codecs.decode(role, q, s, dtype=self.decode_dtype, name=name)

    # ---- export ----------------------------------------------------------------------------------------
    def maybe_modify_converted_hf_weight(self, task, converted_weights_dict, hf_state_dict):
        """Pass through: re-encoding waits until adapters are merged (see `stream_weights_megatron_to_hf`)."""
        return converted_weights_dict

    def stream_weights_megatron_to_hf(self, megatron_model, hf_pretrained, cpu: bool = True,
                                      show_progress: bool = True, conversion_tasks=None,
                                      merge_adapter_weights: bool = True,
                                      weight_dtype: Optional[torch.dtype] = None) -> Iterator[HFWeightTuple]:
        """Megatron -> release tensors: gathered, LoRA merged (grouped `wo_a` included), then stored as the
        release stores them (quantized with the checkpoint's scales as `like_scale`, others cast). With
        `weight_dtype`, nothing is re-quantized and everything is cast to it."""
        from dsv4flash.integrations.mbridge.grouped_lora import grouped_adapters

        models = megatron_model if isinstance(megatron_model, list) else [megatron_model]
        deltas = {}
        if merge_adapter_weights:
            for prefix, wrapper in _all_grouped(models, grouped_adapters).items():
                deltas[megatron_lookup(prefix + ".weight").release[0]] = _gather_groups(wrapper.delta_weight())
        hf_state_dict = hf_pretrained.state if hasattr(hf_pretrained, "state") else {}
        stream = super().stream_weights_megatron_to_hf(megatron_model, hf_pretrained, cpu=cpu,
                                                       show_progress=show_progress, conversion_tasks=conversion_tasks,
                                                       merge_adapter_weights=merge_adapter_weights,
                                                       weight_dtype=weight_dtype)
        for name, tensor in stream:
            name = name.replace(".base_layer.", ".")  # unmerged export names the base like PEFT; the release does not
            if name in deltas:
                tensor = (tensor.float() + deltas.pop(name).to(tensor.device)).to(tensor.dtype)
            if weight_dtype is not None:
                yield HFWeightTuple(name, tensor.to(weight_dtype))
            else:
                yield from self._to_release(name, tensor, hf_state_dict)
        if deltas:
            raise RuntimeError(f"grouped adapters on {sorted(deltas)[:3]} had no base weight in the export")
        for model in models:  # host-pinned Engram tables: not parameters, so not in Megatron-Bridge's stream
            for prefix, table in _host_tables(model).items():
                name = megatron_lookup(prefix + ".embed.weight").release[0]
                if table.fp8:  # already the release's E4M3 rows + E8M0 scales: row views, no copy, no re-encode
                    yield from _row_views(name, table.weight, self.engram_rows_per_chunk)
                    yield from _row_views(scale_name(name), table.scale.view(torch.float8_e8m0fnu),
                                          self.engram_rows_per_chunk)
                elif weight_dtype is not None:
                    yield from _row_views(name, table.weight, self.engram_rows_per_chunk, weight_dtype)
                else:
                    yield from self._to_release(name, table.weight, hf_state_dict)

    def _to_release(self, name: str, tensor: torch.Tensor, hf_state_dict) -> Iterator[HFWeightTuple]:
        role = quant_role(name)
        if role == QuantRole.ENGRAM_FP8:  # per-row codec: chunk-wise encode is the whole encode, bit for bit
            yield from self._engram_to_release(name, tensor, hf_state_dict)
            return
        if role in _QUANTIZED:
            like = hf_state_dict[scale_name(name)]
            q, s = codecs.encode(role, tensor, like_scale=like, name=name)
            yield HFWeightTuple(name, q)
            yield HFWeightTuple(scale_name(name), s)
            return
        yield HFWeightTuple(name, tensor.to(_stored_dtype(name, hf_state_dict)))

    def _engram_to_release(self, name: str, table: torch.Tensor, hf_state_dict) -> Iterator[HFWeightTuple]:
        """An Engram table re-encoded row chunk by row chunk (each weight chunk, then its scale chunk)."""
        total, step, scale = table.shape[0], self.engram_rows_per_chunk, scale_name(name)
        for r0 in range(0, total, step):
            r1 = min(total, r0 + step)
            like = _read_rows(hf_state_dict, scale, r0, r1)
            q, s = codecs.encode(QuantRole.ENGRAM_FP8, table[r0:r1], like_scale=like, name=name)
            yield HFWeightTuple(name, RowChunk(q, r0, total))
            yield HFWeightTuple(scale, RowChunk(s, r0, total))

    def stream_adapter_weights_megatron_to_hf(self, megatron_model, cpu: bool = True, show_progress: bool = True,
                                              exclude_adapter_base_prefixes: Optional[Iterable[str]] = None
                                              ) -> Iterator[HFWeightTuple]:
        """Unmerged adapters with release names: block-diagonal `wo_a` factors first (`<wo_a>.lora_A.weight`
        [G, r, in_g] / `.lora_B.weight` [G, out_g, r], or the shared-A shapes), then Megatron-Bridge's own."""
        from dsv4flash.integrations.mbridge.grouped_lora import grouped_adapters

        models = megatron_model if isinstance(megatron_model, list) else [megatron_model]
        excluded = list(exclude_adapter_base_prefixes or ())
        grouped = _all_grouped(models, grouped_adapters)
        for prefix, wrapper in grouped.items():
            if excluded and prefix.startswith(tuple(excluded)):
                continue
            stem = megatron_lookup(prefix + ".weight").release[0].removesuffix(".weight")
            a, b = wrapper.adapter.lora_A.detach(), wrapper.adapter.lora_B.detach()
            if wrapper.adapter.mode == "per_group":
                a = _gather_groups(a)
            b = _gather_groups(b)
            yield HFWeightTuple(f"{stem}.lora_A.weight", a.cpu() if cpu else a)
            yield HFWeightTuple(f"{stem}.lora_B.weight", b.cpu() if cpu else b)
        yield from _with_all_expert_adapters(super().stream_adapter_weights_megatron_to_hf(
            megatron_model, cpu=cpu, show_progress=show_progress,
            exclude_adapter_base_prefixes=excluded + list(grouped)), _sequential_experts(models))


_EXPERT_ADAPTER = re.compile(r"(\.ffn\.experts\.)(\d+)(\.)")


def _sequential_experts(models: List[torch.nn.Module]) -> int:
    """The routed-expert count when the experts are sequential (`.local_experts.N`), else 0 (grouped GEMM:
    Megatron-Bridge gathers those adapters over EP itself)."""
    sequential = any(".local_experts." in name for name, _ in models[0].named_parameters())
    return models[0].config.num_moe_experts if sequential else 0


def _with_all_expert_adapters(tuples: Iterable[HFWeightTuple], num_experts: int) -> Iterator[HFWeightTuple]:
    """Every expert's adapters, under global expert numbers, on every expert-parallel rank.

    Megatron-Bridge 0.6 does not shard adapter names over EP ("adapters are not sharded across EP ranks",
    `_megatron_local_name_to_global`): with sequential experts (`.local_experts.N`) each EP rank exports only
    its own experts' factors, numbered locally 0 … E/EP−1, so a rollout fed by rank 0 would get the wrong
    factors for experts E/EP … E−1. Here each rank renumbers its per-expert factors (global = EP rank · E/EP +
    local) and all ranks exchange them. Non-expert adapters stream through as they come; the exchanged
    expert factors are host tensors (they travel as pickled objects).
    """
    ep = parallel_state.get_expert_model_parallel_world_size()
    if ep == 1 or not num_experts:
        yield from tuples
        return
    first = parallel_state.get_expert_model_parallel_rank() * (num_experts // ep)
    local = []
    for item in tuples:
        if _EXPERT_ADAPTER.search(item.param_name):
            name = _EXPERT_ADAPTER.sub(lambda m: f"{m[1]}{int(m[2]) + first}{m[3]}", item.param_name, count=1)
            local.append((name, item.weight.detach().cpu()))
        else:
            yield item
    gathered: list = [None] * ep
    torch.distributed.all_gather_object(gathered, local, group=parallel_state.get_expert_model_parallel_group())
    for rank_pairs in gathered:
        for name, weight in rank_pairs:
            yield HFWeightTuple(name, weight)


def release_config(hf_pretrained) -> DSV41FlashConfig:
    """The V4.1 config of a pretrained wrapper: its `.dsv4`, else its directory's `config.json`."""
    cfg = getattr(hf_pretrained, "dsv4", None)
    if cfg is not None:
        return cfg
    path = getattr(hf_pretrained, "model_name_or_path", None)
    if path is None:
        raise ValueError("DSV41Bridge needs a checkpoint directory (model_name_or_path) or a `.dsv4` config")
    from pathlib import Path

    return load_config(Path(path) / "config.json")


def _host_tables(model: torch.nn.Module) -> dict:
    """Engram module name -> its host table, for Engram layers that keep the table outside parameters."""
    out = {}
    for name, module in model.named_modules():
        table = getattr(module, "table", None)
        if table is not None and hasattr(table, "skip_load") and name.endswith(".engram"):
            out[name.removeprefix("module.")] = table
    return out


def _reader(hf_state_dict):
    """The release reader behind a `ReleasePretrained` state (positioned row reads), else None."""
    return getattr(getattr(hf_state_dict, "source", None), "reader", None)


def _read_rows(hf_state_dict, name: str, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of a checkpoint tensor, read in place when the source can (no whole-tensor read):
    Megatron-Bridge's `StateDict.load_rows` where it exists (DSV41-MBRIDGE-003, patched or its twin)."""
    load_rows = getattr(hf_state_dict, "load_rows", None)
    if load_rows is not None:
        return load_rows(name, r0, r1)
    reader = _reader(hf_state_dict)
    return reader.read_rows(name, r0, r1) if reader is not None else hf_state_dict[name][r0:r1]


def _rows(hf_state_dict, name: str) -> int:
    """Row count of a checkpoint tensor, from the header when the source can tell without reading."""
    get_shape = getattr(hf_state_dict, "get_shape", None)
    if get_shape is not None:
        return get_shape(name)[0]
    reader = _reader(hf_state_dict)
    return reader.info(name).rows if reader is not None else hf_state_dict[name].shape[0]


def _row_views(name: str, tensor: torch.Tensor, rows_per_chunk: int, dtype: Optional[torch.dtype] = None
               ) -> Iterator[HFWeightTuple]:
    """A table as `RowChunk`s of views (cast chunk by chunk when `dtype` is given)."""
    total = tensor.shape[0]
    for r0 in range(0, total, rows_per_chunk):
        rows = tensor[r0:r0 + rows_per_chunk]
        yield HFWeightTuple(name, RowChunk(rows if dtype is None else rows.to(dtype), r0, total))


@torch.no_grad()
def _fill_table(table, name: str, hf_state_dict, rows_per_chunk: int = 1 << 16) -> None:
    """Stream a release Engram table into a host table, row chunk by row chunk: E4M3 rows and E8M0 scales
    copied as stored into an FP8 table, decoded into a float one. A table another rank fills is skipped."""
    if table.skip_load:
        return
    scale = scale_name(name)
    total = _rows(hf_state_dict, name)
    if total != table.weight.shape[0]:
        raise ValueError(f"{name}: {total} rows in the checkpoint, the host table has {table.weight.shape[0]}")
    wide = _stored_dtype(name, hf_state_dict) in _WIDE_FLOATS  # a dequantized checkpoint: no `.scale`
    for r0 in range(0, total, rows_per_chunk):
        r1 = min(total, r0 + rows_per_chunk)
        if wide:
            rows = _read_rows(hf_state_dict, name, r0, r1)
            if table.fp8:
                q, s = codecs.encode_engram_fp8(rows.float(), name=name)
                table.weight[r0:r1].view(torch.uint8).copy_(q.view(torch.uint8))
                table.scale[r0:r1].view(torch.uint8).copy_(s.view(torch.uint8))
            else:
                table.weight[r0:r1].copy_(rows)
            continue
        q, s = _read_rows(hf_state_dict, name, r0, r1), _read_rows(hf_state_dict, scale, r0, r1)
        if table.fp8:
            table.weight[r0:r1].view(torch.uint8).copy_(q.view(torch.uint8))
            table.scale[r0:r1].view(torch.uint8).copy_(s.view(torch.uint8))
        else:
            table.weight[r0:r1].copy_(codecs.decode(QuantRole.ENGRAM_FP8, q, s, dtype=table.weight.dtype, name=name))


def _stored_dtype(name: str, hf_state_dict) -> torch.dtype:
    """The release dtype of an unquantized tensor (from the header when the source can tell without reading)."""
    source = getattr(hf_state_dict, "source", None)
    if source is not None and hasattr(source, "info"):
        return source.info(name).torch_dtype
    return hf_state_dict[name].dtype


def _all_grouped(models: List[torch.nn.Module], finder) -> dict:
    """Grouped adapters of every model chunk, by Megatron module name."""
    out = {}
    for model in models:
        out.update(finder(model))
    return out


def _gather_groups(local: torch.Tensor) -> torch.Tensor:
    """Concatenate a per-group tensor's tensor-parallel shards along dim 0 (groups are split over TP)."""
    if not parallel_state.model_parallel_is_initialized():
        return local
    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    torch.distributed.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=0)
