"""The reference engine behind the dsv4flash rollout server: one resident base, the synced adapter bound per call.

`RolloutEngine` holds the base once (`dsv4flash.engine.resident.ResidentBase`); an adapter sync never merges:
the received LoRA tensors become a placement shell's factors, plugged in for each generation (`bind`). A
request is one prompt (compact: one `image_token_id` placeholder per image) sampled with the CSA2 decode
cache (`dsv4flash.engine.sampling.generate`); the routes every MoE gate chose are recorded during that very
generation and returned in the compact text-only form the project's replay reads (`dsv4flash.replay`): one
row per compact token but the last, an image placeholder carrying its span's first row (never replayed).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dsv4flash.integrations.verl.rollout.weights import ReleaseDecoder

# rollout.dtype -> autocast dtype of generation (the resident base stays fp32; None = fp32 compute)
DTYPES = {"float32": None, "fp32": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
# sampling_params keys a veRL agent loop sends; anything else is refused by name (a silent ignore samples wrongly)
_KNOWN_PARAMS = {"temperature", "top_p", "top_k", "repetition_penalty", "logprobs", "max_tokens", "max_new_tokens",
                 "ignore_eos", "seed", "prompt_logprobs"}


@dataclass
class Generation:
    """One request's result: response ids, their sampled log-probs, compact routes [R, L, k] and why it stopped."""

    token_ids: list[int]
    log_probs: list[float]
    routed_experts: np.ndarray | None
    stop_reason: str
    adapter_version: int = 0  # syncs applied when the request ran (0: the base as loaded)
    prompt_ids: list[list[int]] | None = None  # vLLM's prompt log-probs layout (see `prompt_logprobs`)
    prompt_logprobs: list[list[float]] | None = None


class RolloutEngine:
    """Reference-model generation for veRL requests, with the last synced adapter (unmerged) or the bare base."""

    def __init__(self, base_dir: str | Path, *, seed: int = 0, dtype: str = "float32") -> None:
        from dsv4flash.engine import model_io
        from dsv4flash.engine.resident import ResidentBase

        if dtype not in DTYPES:
            raise ValueError(f"actor_rollout_ref.rollout.dtype={dtype!r}: the dsv4flash rollout computes in one of "
                             f"{sorted(DTYPES)}")
        self.autocast = DTYPES[dtype]
        base_dir = Path(base_dir)
        model_io.read_manifest(base_dir)  # a clear error when the path is not a dsv4flash base directory
        # the CPU rollout replica (fp32 base, `autocast` for the rollout dtype); CUDA rollouts are vLLM's
        self.base = ResidentBase(str(base_dir / "config.json"), base_dir=base_dir, device="cpu", dtype="float32")
        self.cfg = self.base.cfg
        self.adapter: tuple | None = None  # (LoraConfig placement, canonical tensors)
        self.version = 0  # adapter syncs applied
        self._decoder = ReleaseDecoder()
        self._seeds = torch.Generator().manual_seed(seed)
        self._seed_lock = threading.Lock()

    # ---- weight sync (weights.py turns the payloads into reference terms) -----------------------------
    def set_adapter(self, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
        """Bind a synced LoRA (`weights.adapter_from_sync`) as the adapter; the resident base is untouched."""
        from dsv4flash.integrations.verl.rollout.weights import adapter_from_sync

        placement, canonical = adapter_from_sync(tensors, peft_config, self.cfg)
        self.base.shell(placement)  # built before the swap: generation keeps running on the old adapter
        with self.base.lock:
            self.adapter = (placement, canonical)
            self.version += 1

    def load_base_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy base tensors (full precision or release layout, `weights.ReleaseDecoder`) into the resident base
        -> parameters written; `finish_base_sync` ends the sync."""
        params = dict(self.base.model.named_parameters())
        written = 0
        with self.base.lock, torch.no_grad():
            for name, t in tensors:
                done = self._decoder.feed(name, t)
                if done is None:
                    continue
                key, full = done
                if key not in params:
                    raise KeyError(f"base sync: tensor {name!r} is not a parameter of the reference model")
                if tuple(full.shape) != tuple(params[key].shape):
                    raise ValueError(f"base sync: tensor {name!r} has shape {list(full.shape)}, the model expects "
                                     f"{list(params[key].shape)}")
                params[key].copy_(full.to(params[key].dtype))
                written += 1
        return written

    def finish_base_sync(self) -> None:
        """Refuse a base sync that left a quantized payload without its scale (or the reverse)."""
        self._decoder.finish()

    def drop_adapter(self) -> None:
        """Sample from the bare base again (a merged, full-weight sync)."""
        with self.base.lock:
            self.adapter = None

    # ---- generation -------------------------------------------------------------------------------
    def next_seed(self) -> int:
        """A per-request seed from the server's own generator (deterministic per server seed)."""
        with self._seed_lock:
            return int(torch.randint(0, 2**31 - 1, (1,), generator=self._seeds))

    def generate(self, prompt_ids: list[int], sampling_params: dict, *, max_tokens: int, images=None,
                 ignore_eos: bool = False, record_routes: bool = False) -> Generation:
        """Sample one continuation of `prompt_ids` (compact or with expanded image spans; images given separately)
        with the current adapter; routes and prompt log-probs are always in the compact layout."""
        from dsv4flash.engine.sampling import Sampling, check_sampling_params, generate
        from dsv4flash.model.image import (TEXT, ImageInput, compact_image_placeholders, prepare_vl_inputs,
                                           preprocess_image)
        from dsv4flash.replay import reference

        unknown = sorted(set(sampling_params) - _KNOWN_PARAMS)
        if unknown:
            raise ValueError(f"dsv4flash rollout: unsupported sampling_params {unknown} (supported: "
                             f"{sorted(_KNOWN_PARAMS)})")
        if float(sampling_params.get("repetition_penalty", 1.0)) != 1.0:
            raise ValueError(f"dsv4flash rollout: sampling_params.repetition_penalty must be 1.0, got "
                             f"{sampling_params['repetition_penalty']!r}")
        temperature, top_k = float(sampling_params.get("temperature", 1.0)), int(sampling_params.get("top_k", -1))
        top_p, seed = float(sampling_params.get("top_p", 1.0)), sampling_params.get("seed")
        check_sampling_params(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        top_prompt = sampling_params.get("prompt_logprobs")
        if top_prompt is not None and (isinstance(top_prompt, bool) or not isinstance(top_prompt, int)
                                       or top_prompt < 0):
            raise ValueError(f"dsv4flash rollout: sampling_params.prompt_logprobs must be an integer ≥ 0 or None, "
                             f"got {top_prompt!r}")
        vocab = self.cfg.text.vocab_size
        bad = [i for i, t in enumerate(prompt_ids) if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"dsv4flash rollout: prompt token at position {bad[0]} is {prompt_ids[bad[0]]}, "
                             f"outside the vocabulary [0, {vocab})")
        images = [img if isinstance(img, ImageInput) else preprocess_image(img, self.cfg, torch.float32)
                  for img in (images or [])]
        if images:
            # veRL's multimodal tokenization (a HF processor) sends the spans expanded, as vLLM receives them.
            prompt_ids = compact_image_placeholders(prompt_ids, images, self.cfg)
            ids, types, inputs = prepare_vl_inputs(prompt_ids, images, self.cfg, dtype=torch.float32)
        else:
            ids = torch.as_tensor(prompt_ids, dtype=torch.int64)
            types, inputs = torch.full_like(ids, TEXT), []
        seed = seed if seed is not None else self.next_seed()
        gen = torch.Generator().manual_seed(int(seed))
        eos = None if ignore_eos else self.cfg.eos_token_id
        sampling = Sampling(temperature, top_k, top_p)
        with self._model() as (model, version):
            recorder = reference.record_routes(model) if record_routes else contextlib.nullcontext([])
            with recorder as records:
                out = generate(model, [(ids, types, inputs)], max_new_tokens=max_tokens, eos_id=eos,
                               pad_id=self.cfg.pad_token_id, sampling=sampling, generator=gen,
                               autocast_dtype=self.autocast)
            if top_prompt is None:
                scored = None
            else:
                with torch.autocast("cpu", dtype=self.autocast, enabled=self.autocast is not None):
                    scored = prompt_logprobs(model, prompt_ids, ids, types, inputs, top_prompt)
        tokens = out.response(0)
        log_probs = out.response_logprobs(0)
        routes = _compact_routes(records, len(reference._gates(self.base.model)), types, len(tokens)) \
            if record_routes else None
        prompt_ids_out, prompt_lp = scored if scored is not None else (None, None)
        return Generation(tokens, log_probs, routes, "completed",  # eos or max_tokens: vLLM's stop/length
                          adapter_version=version, prompt_ids=prompt_ids_out, prompt_logprobs=prompt_lp)

    @contextlib.contextmanager
    def _model(self):
        """(model, adapter version) under the base lock: the shell with the adapter bound, or the bare base."""
        with self.base.lock:  # re-entrant: `bind` takes it again; a sync swaps the adapter under it too
            adapter, version = self.adapter, self.version
            with (self.base.bare() if adapter is None else self.base.bind(*adapter)) as model:
                yield model, version


@torch.no_grad()
def prompt_logprobs(model, compact_ids: list[int], ids: torch.Tensor, types: torch.Tensor, inputs: list,
                    k: int) -> tuple[list[list[int]], list[list[float]]]:
    """vLLM's prompt log-probs as veRL reads them (`extract_prompt_logprobs`): for compact prompt tokens 1 … S−1,
    k = 0: [[the token]] and [[its log-prob]]; k > 0: the top-k ids and log-probs of that position's
    distribution; then one dummy [0.0] row for the last position. Raw log-softmax (no temperature)."""
    from dsv4flash.engine.sampling import next_token_logprobs
    from dsv4flash.replay import ImageSpanLayout

    logp = next_token_logprobs(model, ids, types, inputs)  # [S_e, V]
    rows = ImageSpanLayout.from_token_types(types).expanded_rows()  # compact -> expanded row
    before = logp[rows[1:] - 1]  # [S−1, V]: the distribution each compact token 1 … S−1 was drawn from
    if k == 0:
        target = torch.tensor(compact_ids[1:], dtype=torch.int64)[:, None]
        out_ids, out_lp = target.tolist(), before.gather(-1, target).tolist()
    else:
        top = before.topk(min(k, before.shape[-1]), dim=-1)
        out_ids, out_lp = top.indices.tolist(), top.values.tolist()
    width = max(k, 1)
    return out_ids + [[0] * width], out_lp + [[0.0] * width]


def _compact_routes(records: list[torch.Tensor], n_layers: int, prompt_types: torch.Tensor,
                    n_tokens: int) -> np.ndarray:
    """Gate records of one generation (prefill, then one row per decode step; each layer in turn) -> compact
    routes [compact prompt + response − 1, L, k] int32."""
    from dsv4flash.replay import ImageSpanLayout

    if len(records) % n_layers:
        raise RuntimeError(f"route recording: {len(records)} gate calls is not a multiple of {n_layers} MoE layers")
    per_layer = [torch.cat(records[layer::n_layers]) for layer in range(n_layers)]  # each [R_e, k]
    expanded = torch.stack(per_layer, dim=1)  # [R_e, L, k]
    prompt = ImageSpanLayout.from_token_types(prompt_types)
    full = ImageSpanLayout(prompt.compact_len + n_tokens, prompt.placeholder_rows, prompt.span_lengths)
    if expanded.shape[0] != full.expanded_len - 1:
        raise RuntimeError(f"route recording: {expanded.shape[0]} rows for an expanded sequence of "
                           f"{full.expanded_len} tokens (expected one fewer)")
    return expanded[full.expanded_rows()[: full.compact_len - 1]].to(torch.int32).numpy()
