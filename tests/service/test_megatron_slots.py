"""The Megatron trainer backend's exact parts, without Ray: the adapter map read off an export, rank padding
(a rank-r policy inside a rank-R shell trains exactly as its own rank-r LoRA does: the padded rows and columns
stay zero under the gradient and Adam), per-policy slots swapping adapter, moments, step, gradients and scaling,
and the serve flags."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsv4flash.service.compute.megatron.layout import ComputePlane, TrainerLayout
from dsv4flash.service.compute.megatron.mapping import (AdapterMap, cut_from_shell, digits_needed, pad_to_shell,
                                                        probe_values)
from dsv4flash.service.compute.megatron.slots import SlotStore, alpha_for


# ---- a two-rank "model" and its export: a fused gate‖up A shared by two release modules, experts split ----
def _ranks():
    """Per rank: (Megatron name, shape) of its adapter parameters (a dense pair replicated, one expert each)."""
    dense = [("fc1.adapter.linear_in.weight", (2, 3)), ("fc1.adapter.linear_out.weight", (4, 2))]
    return [dense + [("experts.0.lin.adapter.linear_in.weight", (2, 3))],
            dense + [("experts.0.lin.adapter.linear_in.weight", (2, 3))]]


def _export(rank: int, values: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a bridge export of that rank gives in canonical terms: w1/w3 share fc1's A and split its B; the expert
    A of rank r is expert r (every rank streams both experts; here the other rank's copy comes from `OTHER`)."""
    a, b, e = values
    experts = [None, None]
    experts[rank] = e
    experts[1 - rank] = OTHER[1 - rank]
    return {"w1.lora_A.weight": a, "w3.lora_A.weight": a, "w1.lora_B.weight": b[:2], "w3.lora_B.weight": b[2:],
            "experts.lora_A.weight": torch.stack(experts)}


OTHER: dict[int, torch.Tensor] = {}


def _map() -> AdapterMap:
    ranks = _ranks()
    numels = [sum(torch.Size(s).numel() for _, s in p) for p in ranks]
    offsets = [0, numels[0]]
    bits = 3  # tiny digits: several probe passes, as a bf16 model needs
    codes = [None, None]
    for digit in range(digits_needed(sum(numels), bits)):
        probes = [[v.view(s).double() for v, (_, s) in zip(probe_values([torch.Size(s).numel() for _, s in p],
                                                                        offsets[r], bits, digit), p)]
                  for r, p in enumerate(ranks)]
        for r in (0, 1):
            OTHER[r] = probes[r][2]
        for r in (0, 1):
            out = _export(r, probes[r])
            keys = sorted(out)
            flat = torch.cat([out[k].reshape(-1) for k in keys]).long() << (bits * digit)
            codes[r] = flat if codes[r] is None else codes[r] + flat
    out = _export(0, [torch.zeros(s) for _, s in ranks[0]])
    keys = sorted(out)
    return AdapterMap.from_codes(keys, [tuple(out[k].shape) for k in keys], ranks, codes)


def test_the_map_exports_and_imports_exactly_and_refuses_what_megatron_cannot_hold():
    amap = _map()
    gen = torch.Generator().manual_seed(0)
    local = [torch.randn(n, generator=gen) for n in amap.rank_numels()]
    local[1][:14] = local[0][:14]  # the dense adapter is replicated over data-parallel ranks
    canonical = amap.to_canonical(local)
    assert torch.equal(canonical["w1.lora_A.weight"], canonical["w3.lora_A.weight"])  # one shared A, two copies
    assert torch.equal(canonical["experts.lora_A.weight"][1], local[1][14:].view(2, 3))  # rank 1's expert
    back = amap.to_local(canonical)
    assert all(torch.equal(a, b) for a, b in zip(back, local))
    amap.check_roundtrip(canonical, "policy p")
    broken = dict(canonical, **{"w3.lora_A.weight": canonical["w3.lora_A.weight"] + 1})
    with pytest.raises(ValueError, match="tensor w3.lora_A.weight cannot be held"):
        amap.check_roundtrip(broken, "policy p")
    # an import takes the first copy (w1's A): a fresh adapter with two different As is projected onto it
    projected = amap.to_canonical(amap.to_local(broken))
    assert torch.equal(projected["w3.lora_A.weight"], canonical["w1.lora_A.weight"])


def test_a_rank_r_policy_padded_into_the_shell_trains_exactly_like_its_own_lora():
    torch.manual_seed(0)
    r, big, d_in, d_out = 3, 8, 6, 5
    x = torch.randn(7, d_in)
    target = torch.randn(7, d_out)
    a0, b0 = torch.randn(r, d_in) * 0.3, torch.randn(d_out, r) * 0.3

    def train(a, b, scale, steps=5):
        a, b = nn.Parameter(a.clone()), nn.Parameter(b.clone())
        opt = torch.optim.AdamW([a, b], lr=1e-2, weight_decay=0.1)
        for _ in range(steps):
            loss = ((x @ a.t() @ b.t() * scale - target) ** 2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return a.detach(), b.detach(), opt

    alpha = 2.0 * r
    small_a, small_b, _ = train(a0, b0, alpha / r)
    shell = pad_to_shell({"m.lora_A.weight": a0, "m.lora_B.weight": b0, }, ["m.lora_A.weight", "m.lora_B.weight"],
                         [(big, d_in), (d_out, big)])
    scale = alpha_for(alpha / r, big) / big  # what a swap sets on the rank-`big` module
    assert scale == alpha / r
    pa, pb, opt = train(shell["m.lora_A.weight"], shell["m.lora_B.weight"], scale)
    assert not pa[r:].any() and not pb[:, r:].any()  # the padding stayed exactly zero, moments included
    state = opt.state[opt.param_groups[0]["params"][0]]
    assert not state["exp_avg"][r:].any() and not state["exp_avg_sq"][r:].any()
    out = cut_from_shell({"m.lora_A.weight": pa, "m.lora_B.weight": pb},
                         {"m.lora_A.weight": (r, d_in), "m.lora_B.weight": (d_out, r)}, "policy p")
    torch.testing.assert_close(out["m.lora_A.weight"], small_a, rtol=1e-6, atol=1e-7)  # zeros add nothing but
    torch.testing.assert_close(out["m.lora_B.weight"], small_b, rtol=1e-6, atol=1e-7)  # summation order
    with pytest.raises(RuntimeError, match="nonzero values beyond the policy's rank 3"):
        cut_from_shell({"m.lora_A.weight": torch.ones(big, d_in), "m.lora_B.weight": pb},
                       {"m.lora_A.weight": (r, d_in), "m.lora_B.weight": (d_out, r)}, "policy p")


class _Adapter(nn.Module):
    """A Megatron-Bridge-like adapter: alpha / dim scaling read at every forward."""

    def __init__(self, dim=4):
        super().__init__()
        self.dim, self.alpha = dim, 8
        self.linear_in = nn.Linear(3, dim, bias=False)
        self.linear_out = nn.Linear(dim, 2, bias=False)

    def forward(self, x):
        return self.linear_out(self.linear_in(x)) * (self.alpha / self.dim)


class _FP32Optimizer:
    """Megatron's FP32Optimizer shape: a torch optimizer over the model parameters."""

    def __init__(self, params):
        self.optimizer = torch.optim.AdamW(params, lr=1e-2)


def test_slots_swap_policies_exactly_whatever_runs_between():
    torch.manual_seed(1)
    model = _Adapter()
    params = [(n, p) for n, p in model.named_parameters()]
    for _, p in params:
        p.main_grad = torch.zeros_like(p)
    store = SlotStore(params, [(model, "dim")], _FP32Optimizer([p for _, p in params]), pin=False)
    x = torch.randn(5, 3)

    def step(policy):
        store.activate(policy)
        loss = model(x).pow(2).sum()
        grads = torch.autograd.grad(loss, [p for _, p in params])
        for (_, p), g in zip(params, grads):
            p.main_grad.add_(g)
        store.commit_grads(policy)
        for _, p in params:
            p.grad = p.main_grad.clone()
        store.optimizers[0].step()
        for _, p in params:
            p.main_grad.zero_()
            p.grad = None
        store.commit_step(policy)

    inits = {name: torch.randn(store.numel()) for name in ("a", "b")}
    for name, scale in (("a", 2.0), ("b", 0.5)):
        store.create(name, inits[name], scale)
    for _ in range(3):  # a, b interleaved
        step("a")
        step("b")
    interleaved = {n: store.slot(n).as_state() for n in ("a", "b")}
    alone = SlotStore(params, [(model, "dim")], _FP32Optimizer([p for _, p in params]), pin=False)
    store = alone
    store.create("a", inits["a"], 2.0)
    for _ in range(3):
        step("a")
    for part in ("value", "exp_avg", "exp_avg_sq"):
        assert torch.equal(interleaved["a"][part], store.slot("a").as_state()[part]), part
    assert interleaved["a"]["step"] == 3 and interleaved["b"]["step"] == 3
    assert model.alpha / model.dim == 2.0  # a's scaling is live
    # value, gradient, two moments and the step scalar of each parameter: one policy's, however many slots
    assert store.live_bytes() == sum(p.numel() * 4 * 4 + 4 for _, p in params)


def test_serve_flags_are_checked_naming_the_flag():
    assert TrainerLayout.parse("ep=16,cp=2").world() == 16
    assert TrainerLayout.parse("ep=2").world() == 2 and TrainerLayout.parse("").world() == 1
    assert TrainerLayout.parse("ep=2,tp=2").world(8) == 8
    for text, says in (("ep=0", "ep='0' is not a positive integer"), ("xp=2", "'xp=2' is not one of"),
                       ("ep=2,ep=4", "ep is given twice")):
        with pytest.raises(ValueError, match=f"--trainer-layout: {says}"):
            TrainerLayout.parse(text)
    with pytest.raises(ValueError, match="--workers 3: not a multiple of the layout's ep·tp·pp = 2"):
        TrainerLayout.parse("ep=2").world(3)
    with pytest.raises(ValueError, match="--trainer: 'torch' is not one of local, megatron"):
        ComputePlane(trainer="torch")
    with pytest.raises(ValueError, match="--ray-address: 'nowhere' is not local, auto or HOST:PORT"):
        ComputePlane(ray_address="nowhere")
    assert ComputePlane(ray_address="10.0.0.1:6379").ray_address == "10.0.0.1:6379"


def test_a_layout_the_stack_cannot_train_is_refused_before_any_worker_starts(tmp_path):
    """The group's config goes through the same layout rules as a veRL training run (train/preflight.py)."""
    from dsv4flash.service.compute.megatron.config import actor_config
    from dsv4flash.service.compute.megatron.layout import TrainerLayout
    from dsv4flash.train.preflight import RunConfigError

    with pytest.raises(RunConfigError, match=r"engine\.expert_model_parallel_size=3 must divide"):
        actor_config(tmp_path / "base", "tiny", "decoder_half", 8, TrainerLayout(ep=3), 3, tmp_path / "work",
                     cuda=False, micro_batch=1)
    assert not (tmp_path / "work").exists()
