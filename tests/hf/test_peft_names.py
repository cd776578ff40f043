"""Real PEFT on DeepseekV41ForCausalLM: `task_type=CAUSAL_LM` works (the class is a GenerationMixin) and the
adapter keys are `base_model.model.<release module name>...`, i.e. they name release tensors (no prefix)."""

from __future__ import annotations

import json

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open

from dsv4flash.release.census import census
from dsv4flash.config import load_config
from dsv4flash.hf import DeepseekV41Config, DeepseekV41ForCausalLM


def test_peft_keys_are_release_names_and_causal_lm_round_trips(tmp_path):
    config = DeepseekV41Config.from_dsv4flash("tiny")
    peft = get_peft_model(DeepseekV41ForCausalLM(config, seed=5), LoraConfig(
        task_type="CAUSAL_LM", r=4, target_modules=["wq_a", "wo_b", "w1"], init_lora_weights=False))
    ids = torch.randint(3, 400, (1, 6), generator=torch.Generator().manual_seed(0))
    logits = peft(input_ids=ids).logits
    peft.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    release = {row.name for row in census(load_config("tiny"))}
    prefix = "base_model.model."
    for key in keys:
        assert key.startswith(prefix), key
        module = key[len(prefix):].rsplit(".lora_", 1)[0]
        assert f"{module}.weight" in release, key
    adapted = {key[len(prefix):].rsplit(".lora_", 1)[0] for key in keys if key.startswith(prefix + "layers.")}
    n_layers, n_experts = config.text_config.num_hidden_layers, config.text_config.n_routed_experts
    assert len(adapted) == n_layers * (2 + n_experts + 1)  # wq_a, wo_b, w1 of every routed + the shared expert
    assert "layers.0.ffn.experts.7.w1" in adapted and "layers.11.ffn.shared_experts.w1" in adapted

    loaded = PeftModel.from_pretrained(DeepseekV41ForCausalLM(config, seed=5), tmp_path)
    assert torch.equal(loaded(input_ids=ids).logits, logits)
    greedy = loaded.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    assert greedy.shape == (1, 9) and torch.equal(greedy[:, :6], ids)
    merged = loaded.merge_and_unload()
    assert type(merged) is DeepseekV41ForCausalLM
    torch.testing.assert_close(merged(ids).logits, logits, atol=1e-5, rtol=0)
