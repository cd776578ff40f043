"""The adapter `python -m dsv4flash.train +recipe=decoder_lora` writes loads unchanged in stock PEFT (on the
transformers class, with dsv4flash's logits) and in vLLM's own LoRA loader, and exports without a store."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SMALL_BASE = "model.base_overrides=['engine.steps=2','engine.batch_size=2','data.val_size=2','engine.eval_every=2']"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(training output, cached base directory) of a 2-step decoder_lora run."""
    tmp = tmp_path_factory.mktemp("train")
    cache, out = tmp / "cache", tmp / "run"
    args = ["+recipe=decoder_lora", "engine.steps=2", "engine.batch_size=2", "engine.eval_every=2", "data.val_size=2",
            f"model.cache_dir={cache}", SMALL_BASE, f"output_dir={out}", f"hydra.run.dir={tmp / 'hydra'}"]
    run = subprocess.run([sys.executable, "-m", "dsv4flash.train", *args], capture_output=True, text=True, timeout=900,
                         cwd=REPO, env=dict(os.environ, TORCHDYNAMO_DISABLE="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (base,) = [p.parent for p in (cache / "bases").glob("pretrain_tiny-*/model/model.safetensors")]
    return out, base


@pytest.mark.slow
@pytest.mark.upstream
def test_train_output_loads_in_stock_peft_with_dsv4flash_logits(trained):
    import peft
    from transformers import AutoModelForCausalLM

    import dsv4flash  # noqa: F401  (auto-class registration)
    from dsv4flash.engine import model_io
    from dsv4flash.lora import load_peft_adapter
    from dsv4flash.model.transformer import Transformer

    out, base_dir = trained
    reference = Transformer(model_io.base_config(base_dir), seed=None)
    model_io.load_base_weights(reference, base_dir)
    load_peft_adapter(reference, out / "adapter")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(missing|unexpected).*keys.*")
        wrapped = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out / "adapter")
    from dsv4flash.model.image import ImageInput, expand_image_placeholders

    cfg = reference.cfg
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 499, (2, 20), generator=gen)
    p = cfg.vision.patch_size
    image = ImageInput(torch.randn(18, 3 * p * p, generator=gen), (3, 6))
    prompt = torch.cat([torch.randint(3, 499, (5,), generator=gen), torch.tensor([cfg.image_token_id]),
                        torch.randint(3, 499, (9,), generator=gen)])
    vl_ids, vl_types = (t[None] for t in expand_image_placeholders(prompt, [image], cfg))
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(wrapped(input_ids=ids).logits, reference(ids), rtol=0, atol=1e-5)
        torch.testing.assert_close(wrapped(input_ids=vl_ids, token_types=vl_types, images=[image]).logits,
                                   reference(vl_ids, vl_types, [image]), rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.upstream
def test_train_output_passes_vllm_loading_and_exports_without_a_store(trained, tmp_path):
    import vllm  # noqa: F401  (a test dependency: ci/install.sh test)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from dsv4flash.cli import main
    from dsv4flash.config import load_config
    from dsv4flash.integrations.vllm import adapter_names, register

    register()
    out, _ = trained
    experts = load_config("tiny").text.n_routed_experts
    lora = adapter_names.load_lora_model(out / "adapter", experts, max_lora_rank=32)  # PEFT layout: wo_a at G·r
    assert lora.loras and not lora.is_3d_lora_weight
    assert main(["lifecycle", "export", str(out), str(tmp_path / "vllm"), "--format", "vllm"]) == 0
    served = adapter_names.load_lora_model(tmp_path / "vllm", experts, max_lora_rank=16)  # rank r everywhere
    assert served.loras.keys() == lora.loras.keys()
