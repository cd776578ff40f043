"""One Megatron actor GRPO update at tiny size, the same code on CPU (CUDA redirect) and on a CUDA device.

The actor is built as veRL's Megatron engine builds it, without veRL: `AutoBridge` on a release checkpoint
(FP8 / MXFP4 / FP8 Engram rows decoded by the project's bridge), the bridge's `DSV41BridgeModelProvider` with
the CSA2 layers (local backend) and the host-pinned Engram (`PinnedEngram`), the decoder-half LoRA from the
provider's own `provide_peft` as a pre-wrap hook, `provide_distributed_model` (megatron-core DDP, fp32) and
megatron-core's distributed Adam. The batch is fixed: 2 GRPO groups of 2 (prompt, response) rows, rewards →
`group_advantages`, old log-probs = the actor's own before the update, rollout log-probs = old + fixed noise
(IcePop weights); the loss is the project's `policy_loss` (`dsv4flash.engine.losses`).

`cpu_run_in_subprocess` runs the CPU fp32 update in a child interpreter with no GPU visible, for the CUDA
test to compare with (tests/gpu/test_megatron_grpo_cuda.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

GROUPS, GROUP_SIZE, PROMPT, RESPONSE = 2, 2, 16, 8
LORA_RANK, LR = 8, 1e-2  # lr: the step moves the response log-probs by ~2e-4 (1e-3: ~2e-5)
REWARDS = (1.0, 0.0, 0.2, 0.9)  # per row, group by group
SEED = 11


@dataclass
class GrpoStepResult:
    """What one update produced (every tensor on the CPU, fp32)."""

    logp_before: torch.Tensor  # [B, S] per-token log-probs before the update (the old policy)
    logp_after: torch.Tensor  # [B, S] after the optimizer step
    loss: float
    grad_norm: float
    adapters_before: dict[str, torch.Tensor]  # by local parameter name
    adapters_after: dict[str, torch.Tensor]
    base_before: dict[str, torch.Tensor]  # ~16 frozen parameters spread from the embedding to the head
    base_after: dict[str, torch.Tensor]
    engram_table_before: dict[str, torch.Tensor]  # host Engram tables by layer
    engram_table_after: dict[str, torch.Tensor]
    engram_devices: dict[str, str]  # layer -> where the table lives ("cpu")
    engram_pinned: dict[str, bool]  # layer -> page-locked (True on a CUDA machine)
    engram_classes: dict[str, str]  # layer -> the Engram module's class name
    trainable: list[str]
    model_device: str

    def as_dict(self) -> dict:
        """Plain dict (for torch.save across processes)."""
        return dict(self.__dict__)


def fixed_batch(vocab: int) -> dict[str, torch.Tensor]:
    """ids [B, S], response mask [B, S] (bool), advantages [B], rollout log-prob noise [B, S]."""
    from dsv4flash.engine.losses import group_advantages

    gen = torch.Generator().manual_seed(SEED)
    rows = GROUPS * GROUP_SIZE
    prompts = torch.randint(3, vocab, (GROUPS, PROMPT), generator=gen).repeat_interleave(GROUP_SIZE, 0)
    responses = torch.randint(3, vocab, (rows, RESPONSE), generator=gen)
    ids = torch.cat([prompts, responses], 1)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, PROMPT:] = True
    noise = 0.05 * torch.randn(ids.shape, generator=gen)
    return {"ids": ids, "mask": mask, "advantages": group_advantages(torch.tensor(REWARDS), GROUP_SIZE),
            "noise": noise}


def decoder_half_lora(dsv4) -> dict:
    """The decoder-half placement (layer `decoder_start`'s KV write frozen) as veRL's `lora` mapping."""
    from dsv4flash.lora import LoraConfig
    from dsv4flash.train.verl_config import megatron_lora_targets

    lcfg = LoraConfig(preset="decoder_half", rank=LORA_RANK)  # alpha = 2·rank
    return {"type": "lora", "rank": lcfg.rank, "alpha": int(lcfg.alpha), "dropout": 0.0,
            "target_modules": megatron_lora_targets(dsv4, lcfg), "exclude_modules": []}


def build_actor(release: Path):
    """[DDP(DSV41MegatronModel)] with the decoder-half LoRA and pinned Engram, base loaded, and its optimizer."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.peft.utils import create_peft_hook
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from dsv4flash.integrations import mbridge
    from dsv4flash.integrations.mcore.engram import PinnedEngram

    mbridge.register()
    auto = AutoBridge(mbridge.ReleasePretrained(release))
    provider = auto.to_megatron_provider(load_weights=False)
    provider.engram = ModuleSpec(module=PinnedEngram)
    provider.apply_overrides_and_finalize(dtype=torch.float32, overrides={"variable_seq_lengths": True})
    peft = provider.provide_peft(decoder_half_lora(provider.dsv4), dtype=torch.float32)
    provider.register_pre_wrap_hook(create_peft_hook(peft, training=True))
    chunks = provider.provide_distributed_model(
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
        fp16=False, bf16=False)
    auto.load_hf_weights(chunks)
    # LoRA B starts at zero; give every adapter a seeded value so the update moves the log-probs at once.
    with torch.no_grad():
        gen = torch.Generator().manual_seed(SEED + 1)
        for name, param in sorted(chunks[0].module.named_parameters()):
            if ".adapter." in name:
                param.copy_((0.02 * torch.randn(param.shape, generator=gen)).to(param.device))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=LR, weight_decay=0.0, params_dtype=torch.float32, use_distributed_optimizer=True,
        clip_grad=1.0), chunks)
    return chunks, optimizer


def _snapshot(params) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in params}


def _engrams(model) -> dict[str, torch.nn.Module]:
    return {str(i): layer.engram for i, layer in enumerate(model.decoder.layers)
            if getattr(layer, "engram", None) is not None}


def grpo_step(release: str | Path, device: str) -> GrpoStepResult:
    """Build the actor, score the fixed batch, take one GRPO step (needs an initialised Megatron session)."""
    from dsv4flash.engine.losses import policy_loss, rollout_correction, token_logprobs

    chunks, optimizer = build_actor(Path(release))
    ddp = chunks[0]
    model = ddp.module
    model_device = str(next(model.parameters()).device)
    batch = {k: v.to(device) for k, v in fixed_batch(model.config.dsv4.text.vocab_size).items()}
    ids, mask = batch["ids"], batch["mask"]
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    sample = frozen[:: max(1, len(frozen) // 16)]  # a spread of base weights, embedding to head
    adapters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    engrams = _engrams(model)
    tables = {k: e.table.weight for k, e in engrams.items()}
    before = dict(adapters=_snapshot(adapters), base=_snapshot(sample),
                  tables={k: t.clone() for k, t in tables.items()})

    model.train()
    with torch.no_grad():
        old_logp = token_logprobs(ddp(ids), ids)  # [B, S]
    rollout_logp = old_logp + batch["noise"]
    weights, _ = rollout_correction(old_logp, rollout_logp, mask, mode="icepop")
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    new_logp = token_logprobs(ddp(ids), ids)  # [B, S], with grad
    loss, _ = policy_loss(new_logp, old_logp, batch["advantages"], mask, weights=weights)
    loss.backward()
    ddp.finish_grad_sync()
    ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError("the optimizer skipped the update")
    with torch.no_grad():
        logp_after = token_logprobs(ddp(ids), ids)
    return GrpoStepResult(
        logp_before=old_logp.float().cpu(), logp_after=logp_after.float().cpu(), loss=float(loss.detach()),
        grad_norm=float(grad_norm), adapters_before=before["adapters"], adapters_after=_snapshot(adapters),
        base_before=before["base"], base_after=_snapshot(sample), engram_table_before=before["tables"],
        engram_table_after={k: t.clone() for k, t in tables.items()},
        engram_devices={k: str(t.device) for k, t in tables.items()},
        engram_pinned={k: bool(t.is_pinned()) for k, t in tables.items()},
        engram_classes={k: type(e).__name__ for k, e in engrams.items()}, trainable=trainable,
        model_device=model_device)


def cpu_run(release: str | Path) -> GrpoStepResult:
    """`grpo_step` on the CPU in this process: megatron-bridge import shims, CUDA redirect, one gloo rank."""
    from dsv4flash.cpu_mode import mbridge_import
    from tests._threads import single_thread
    from tests.mcore_cpu import parallel

    mbridge_import.install()
    with single_thread(), parallel.model_parallel(seed=1234):
        return grpo_step(release, "cpu")


def check_update(res: GrpoStepResult, decoder_start: int, layers: int) -> None:
    """What any device's update must satisfy: adapters moved, base and Engram tables untouched, finite loss."""
    assert torch.isfinite(torch.tensor(res.loss)) and res.grad_norm > 0
    assert res.trainable and all(".adapter." in n for n in res.trainable)  # the base is frozen
    trained_layers = sorted({int(n.split(".")[2]) for n in res.trainable})
    assert trained_layers == list(range(decoder_start, layers))  # the decoder half
    kv_write = f"decoder.layers.{decoder_start}.self_attention.linear_kv."
    assert not any(n.startswith(kv_write) for n in res.trainable)  # the shared KV writer stays frozen
    moved = [n for n in res.adapters_before if not torch.equal(res.adapters_before[n], res.adapters_after[n])]
    assert moved and set(moved) <= set(res.trainable)
    assert any(".linear_out." in n for n in moved)  # the B factors got a gradient
    for name, before in res.base_before.items():
        assert torch.equal(res.base_after[name], before), f"{name}: a frozen base weight changed"
    assert res.engram_table_before, "no Engram layer in the model"
    assert set(res.engram_classes.values()) == {"PinnedEngram"}
    for layer, before in res.engram_table_before.items():
        assert res.engram_devices[layer] == "cpu"  # host table, never moved with the module
        assert torch.equal(res.engram_table_after[layer].view(torch.uint8), before.view(torch.uint8))
    scored = res.logp_before[:, PROMPT:]
    assert torch.isfinite(res.logp_before).all() and torch.isfinite(res.logp_after).all()
    assert float((res.logp_after[:, PROMPT:] - scored).abs().max()) > 1e-5  # the update moved the policy


def assert_same_update(res: GrpoStepResult, ref: GrpoStepResult) -> None:
    """`res` (e.g. CUDA) is `ref`'s update (the CPU fp32 run) up to another summation order (tolerances:
    tests/gpu/test_megatron_grpo_cuda.py)."""
    assert res.trainable == ref.trainable
    torch.testing.assert_close(res.logp_before, ref.logp_before, rtol=0, atol=1e-4)
    assert abs(res.loss - ref.loss) <= 1e-4 * max(1.0, abs(ref.loss)), (res.loss, ref.loss)
    assert abs(res.grad_norm - ref.grad_norm) <= 1e-3 * ref.grad_norm, (res.grad_norm, ref.grad_norm)
    change, ref_change = res.logp_after - res.logp_before, ref.logp_after - ref.logp_before
    scale = float(ref_change.abs().max())
    assert float((change - ref_change).abs().max()) <= 0.1 * scale, scale

    def update(r: GrpoStepResult) -> torch.Tensor:
        return torch.cat([(r.adapters_after[n] - r.adapters_before[n]).flatten() for n in r.trainable])

    assert float(torch.nn.functional.cosine_similarity(update(res), update(ref), dim=0)) >= 0.99


TESTS_DIR = str(Path(__file__).resolve().parents[1])
# A fresh interpreter resolves `tests` to this repository (the verl wheel installs a top-level `tests` package,
# as tests/mcore_cpu/parallel.py explains), hides any GPU (the CPU run must be the CUDA redirect's) and runs
# `cpu_run` as the CPU tests do.
_CPU_CHILD = """
import importlib.machinery, importlib.util, os, sys, torch
tests = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("tests", None, is_package=True))
tests.__path__ = [os.environ["DSV4FLASH_TESTS_DIR"]]
sys.modules["tests"] = tests
from tests.mbridge import grpo_step
torch.save(grpo_step.cpu_run(sys.argv[1]).as_dict(), sys.argv[2])
"""


def cpu_run_in_subprocess(release: str | Path, out: str | Path, timeout: float = 600) -> GrpoStepResult:
    """`cpu_run` in a child interpreter with no GPU visible (so a CUDA test can compare with it)."""
    import os
    import subprocess

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TORCHDYNAMO_DISABLE": "1",
           "DSV4FLASH_TESTS_DIR": TESTS_DIR}
    run = subprocess.run([sys.executable, "-c", _CPU_CHILD, str(release), str(out)], env=env,
                         capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        raise RuntimeError(f"the CPU run failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
    return GrpoStepResult(**torch.load(out, weights_only=False))
