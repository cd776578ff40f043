"""The adapter directory dsv4flash writes loads in real PEFT, unchanged, on the transformers class.

`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)` with nothing missing or
unexpected, the same logits as the dsv4flash model (fp32, atol 1e-5) on text and image prompts, and
`merge_and_unload()` equal to the unmerged model; the block-diagonal `wo_a` and the routed experts included.
"""

from __future__ import annotations

import warnings

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

import dsv4flash  # noqa: F401  (registers DeepseekV41ForCausalLM with transformers' auto classes)
from dsv4flash.engine import model_io
from dsv4flash.lora import LoraConfig, apply_lora, save_peft_adapter
from dsv4flash.model.transformer import Transformer
from dsv4flash.tasks.tokenizer import TaskTokenizer

from .conftest import randomize_adapters

ATOL = 1e-5
PLACEMENTS = {
    "full_linear": LoraConfig(preset="full_linear", rank=4),
    "decoder_half": LoraConfig(preset="decoder_half", rank=4),
    "shared_params": LoraConfig(preset="no_down_proj", rank=4, expert_lora="shared_outer", wo_a_lora="shared_a"),
    "vit_and_router": LoraConfig(preset="vit_lr_0p1", rank=4, include=["layers.*.attn.wo_a", "layers.*.ffn.gate",
                                                                          "layers.*.ffn.experts.*.w[123]",
                                                                          "layers.*.attn.wq_a"]),
}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tiny_cfg):
    """A dsv4flash base directory (what `python -m dsv4flash.train` caches) of a seeded tiny model."""
    model = Transformer(tiny_cfg, seed=7)
    return model_io.save_base(model, tiny_cfg, TaskTokenizer(tiny_cfg), tmp_path_factory.mktemp("base") / "model",
                              {"source": "test"})


def _adapted(tiny_cfg, cfg: LoraConfig):
    model = Transformer(tiny_cfg, seed=7)
    handle = apply_lora(model, cfg)
    # Rounding-level (1e-7) differences can flip a near tie of the router's or indexer's top-k, which moves
    # later positions by ~1e-3; at this adapter scale these inputs have no such tie (std 0.05 has one).
    randomize_adapters(model, std=0.03)
    return model.eval(), handle


def _peft_model(base_dir, adapter_dir):
    """The user's two lines, failing on any PEFT warning about missing or unexpected adapter keys."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PEFT warns (does not raise) on missing / unexpected adapter keys
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        # PEFT 0.21 checks rank_pattern keys against target_modules matches only, so the wo_a key (a parameter
        # target) is reported as unmatched although it is applied (a rank-r A could not load a [G·r, in_g] tensor)
        warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match")
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        return peft.PeftModel.from_pretrained(base, adapter_dir)


@pytest.mark.upstream
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_stock_peft_loads_the_directory_with_dsv4flash_logits(placement, base_dir, tiny_cfg, tmp_path, ids, vl_batch):
    model, handle = _adapted(tiny_cfg, PLACEMENTS[placement])
    adapter_dir = save_peft_adapter(model, handle, tmp_path / "adapter", base_model_name_or_path=str(base_dir))
    wrapped = _peft_model(base_dir, adapter_dir)
    assert type(wrapped).__name__ == "PeftModelForCausalLM"  # task_type CAUSAL_LM fits the model class
    # nothing dropped: loading again reports no missing and no unexpected adapter keys
    result = wrapped.load_adapter(adapter_dir, adapter_name="again")
    assert result.unexpected_keys == [] and [k for k in result.missing_keys if ".again" in k] == []
    wrapped.set_adapter("default")
    lora_params = sum(p.numel() for n, p in wrapped.named_parameters() if "lora_" in n and ".default" in n)
    assert lora_params >= handle.trainable_params  # every trained parameter has a home (per-group wo_a: G× A rows)

    ids_vl, types_vl, images = vl_batch
    with torch.no_grad():
        ours_text, ours_image = model(ids), model(ids_vl, types_vl, images)
        base = Transformer(tiny_cfg, seed=7)
        base_text, base_image = base(ids), base(ids_vl, types_vl, images)
        theirs_text = wrapped(input_ids=ids).logits
        theirs_image = wrapped(input_ids=ids_vl, token_types=types_vl, images=images).logits
        assert (ours_text - base_text).abs().max() > 1e-2 and (ours_image - base_image).abs().max() > 1e-2
        torch.testing.assert_close(theirs_text, ours_text, rtol=0, atol=ATOL)
        torch.testing.assert_close(theirs_image, ours_image, rtol=0, atol=ATOL)
        wrapped.delete_adapter("again")
        merged = wrapped.merge_and_unload()
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(input_ids=ids).logits, theirs_text, rtol=0, atol=ATOL)
        torch.testing.assert_close(merged(input_ids=ids_vl, token_types=types_vl, images=images).logits, theirs_image,
                                   rtol=0, atol=ATOL)


@pytest.mark.upstream
def test_peft_reports_what_a_damaged_directory_lacks_and_dsv4flash_refuses_it(base_dir, tiny_cfg, tmp_path):
    """PEFT only warns about a missing tensor; dsv4flash's loader refuses the directory naming it."""
    from safetensors.torch import load_file, save_file

    from dsv4flash.lora import load_peft_adapter

    model, handle = _adapted(tiny_cfg, PLACEMENTS["decoder_half"])
    adapter_dir = save_peft_adapter(model, handle, tmp_path / "adapter")
    weights = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    dropped = "base_model.model.layers.7.attn.wo_a.lora_B.weight"
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(weights))
    with pytest.warns(UserWarning, match="missing adapter keys"):
        peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    with pytest.raises(ValueError, match="layers.7.attn.wo_a.lora_A.weight has no layers.7.attn.wo_a.lora_B.weight"):
        load_peft_adapter(Transformer(tiny_cfg, seed=7), adapter_dir)


@pytest.mark.upstream
def test_peft_generate_follows_the_dsv4flash_model(base_dir, tiny_cfg, tmp_path, ids):
    """`task_type: CAUSAL_LM` makes a PeftModelForCausalLM whose generate() is the adapted model's greedy chain."""
    model, handle = _adapted(tiny_cfg, PLACEMENTS["decoder_half"])
    wrapped = _peft_model(base_dir, save_peft_adapter(model, handle, tmp_path / "adapter"))
    prompt = ids[:1, :12]
    with torch.no_grad():
        got = wrapped.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
        want = prompt
        for _ in range(4):  # greedy with the dsv4flash model itself
            want = torch.cat([want, model(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, want)
