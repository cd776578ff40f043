"""Tinker datums as a veRL batch for the Megatron workers, and the loss the workers run on it.

veRL's Megatron engine scores `input_ids` against themselves shifted by one (position t's label is token t+1),
so a datum (model input x_0 … x_{n-1}, targets y_0 … y_{n-1}) goes in as x_0 … x_{n-1} y_{n-1}: position t < n
then scores y_t whenever y_t = x_{t+1}, which is how next-token data is built (tinker-cookbook's SFT and RL
datums). A datum whose targets are not its next inputs is refused, naming the datum and position. The per-token
loss inputs travel as jagged tensors `tk_in_<key>` beside it; `tk_len` is n (0 for the rows that pad the batch
to a multiple of the data-parallel size: a zero-length datum adds nothing). `batch_loss` is the engine's loss
function: the built-in losses of `dsv4flash.service.compute.losses` per datum, summed (Tinker's sum over tokens),
times the data-parallel size that Megatron's gradient all-reduce averages over.
"""

from __future__ import annotations

import torch

from dsv4flash.service.compute import losses

LOSS_KEY, CONFIG_KEY, LEN_KEY, INPUT_PREFIX = "tk_loss_fn", "tk_loss_config", "tk_len", "tk_in_"
SAMPLED_KEY, MU_KEY = "tk_sampled", "tk_mu"  # stable_reinforce's provenance: sampled rows and their sampler log-probs


def next_token_rows(data) -> list[list[int]]:
    """Each datum's veRL input ids (model input plus its last target), or ValueError naming the datum whose
    targets are not the next inputs."""
    rows = []
    for i, d in enumerate(data):
        x = d.model_input.to_ints()
        y = [int(t) for t in d.loss_fn_inputs["target_tokens"].to_torch().reshape(-1).tolist()]
        if len(y) != len(x) or not x:
            raise ValueError(f"datum {i}: model_input has {len(x)} tokens but target_tokens has {len(y)} (they must "
                             f"be equal and non-empty)")
        bad = next((t for t in range(len(x) - 1) if y[t] != x[t + 1]), None)
        if bad is not None:
            raise ValueError(f"datum {i}: target_tokens[{bad}] = {y[bad]} is not the next input token "
                             f"{x[bad + 1]}; the Megatron trainer scores next-token targets only (use --trainer "
                             f"local for arbitrary targets)")
        rows.append(x + [y[-1]])
    return rows


def build_batch(data, loss_fn: str, config: dict | None, provenance: list, dp: int, pad_id: int,
                inputs: list[dict[str, torch.Tensor]] | None = None, micro_batch: int = 8):
    """The veRL TensorDict of one forward(_backward) call; `inputs` overrides each datum's loss inputs (a
    custom loss's surrogate weights). The rows are padded to whole micro-batches of at most `micro_batch` rows on
    each of the `dp` data-parallel ranks (veRL's engine splits a rank's rows into equal micro-batches)."""
    from verl.utils import tensordict_utils as tu

    rows = next_token_rows(data)
    per = inputs if inputs is not None else [
        {k: v.to_torch() for k, v in d.loss_fn_inputs.items() if k != "target_tokens"} for d in data]
    keys = sorted({k for p in per for k in p})
    lengths = [len(r) - 1 for r in rows]
    per_rank = -(-len(rows) // dp)
    micro = min(micro_batch, per_rank)
    pad = dp * micro * -(-per_rank // micro) - len(rows)
    rows += [[pad_id, pad_id]] * pad
    lengths += [0] * pad

    def jagged(values: list[torch.Tensor]) -> torch.Tensor:
        return torch.nested.as_nested_tensor(values, layout=torch.jagged)

    def per_token(values, dtype) -> torch.Tensor:  # one value per input id (the extra last one is 0)
        out = []
        for n, row, v in zip(lengths, rows, values + [None] * pad):
            t = torch.zeros(len(row), dtype=dtype)
            if v is not None and n:
                t[:n] = v.reshape(-1)[:n].to(dtype)
            out.append(t)
        return jagged(out)

    tensors = {"input_ids": jagged([torch.tensor(r, dtype=torch.int64) for r in rows]),
               "loss_mask": jagged([torch.tensor([0] + [1] * (len(r) - 1), dtype=torch.int64) for r in rows]),
               LEN_KEY: torch.tensor(lengths, dtype=torch.int64)}
    for key in keys:
        dtype = torch.float32 if per[0].get(key, torch.zeros(0)).is_floating_point() else torch.int64
        tensors[INPUT_PREFIX + key] = per_token([p.get(key) for p in per], dtype)
    if loss_fn == "stable_reinforce":
        tensors[SAMPLED_KEY] = per_token([p.sampled for p in provenance], torch.int64)
        tensors[MU_KEY] = per_token([p.sampler_logprobs for p in provenance], torch.float32)
    non_tensor = {LOSS_KEY: loss_fn, CONFIG_KEY: dict(config or {}), "temperature": 1.0,
                  "global_token_num": [len(r) for r in rows], "micro_batch_size_per_gpu": micro,
                  "use_dynamic_bsz": False}
    return tu.get_tensordict(tensor_dict=tensors, non_tensor_dict=non_tensor), len(data)


def row_logprobs(output, data) -> list[torch.Tensor]:
    """The target log-probs [n] of each datum from the workers' collected output (rows in order, padding last)."""
    logp = output["log_probs"]
    rows = logp.unbind() if logp.is_nested else list(logp)
    return [rows[i][: d.model_input.length].detach().to("cpu", torch.float32).clone() for i, d in enumerate(data)]


def batch_loss(model_output, data, dp_group=None):
    """veRL's loss-function contract for one micro-batch: (loss, metrics); the loss is Σ datum losses × dp size."""
    from verl.utils import tensordict_utils as tu

    from dsv4flash.service.compute.stability import Provenance

    logp = model_output["log_probs"]
    rows = logp.unbind()
    loss_fn = tu.get_non_tensor_data(data, LOSS_KEY, None)
    config = tu.get_non_tensor_data(data, CONFIG_KEY, None) or {}
    lengths = data[LEN_KEY].tolist()
    columns = {key[len(INPUT_PREFIX):]: data[key].unbind() for key in data.keys() if key.startswith(INPUT_PREFIX)}
    stable = loss_fn == "stable_reinforce"
    sampled, mu = (data[SAMPLED_KEY].unbind(), data[MU_KEY].unbind()) if stable else (None, None)
    total = logp.values().sum() * 0.0  # a graph even when every row is padding
    for i, n in enumerate(lengths):
        if not n:
            continue
        inputs = {k: col[i][:n] for k, col in columns.items()}
        prov = Provenance(sampled[i][:n].bool(), mu[i][:n]) if stable else None
        total = total + losses.datum_loss(loss_fn, rows[i][:n], inputs, config, prov)
    return total * data["dp_size"], {}
