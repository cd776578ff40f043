"""DeepseekV41ForCausalLM is the reference model under transformers' interface: same parameters (release
names), same initialisation, same logits; the loss is transformers' causal-LM loss over them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv4flash.config import load_config
from dsv4flash.hf import DeepseekV41Config, DeepseekV41ForCausalLM
from dsv4flash.model.transformer import Transformer


@pytest.fixture(scope="module")
def pair():
    return DeepseekV41ForCausalLM(DeepseekV41Config.from_dsv4flash("tiny"), seed=9), Transformer(load_config("tiny"),
                                                                                                  seed=9)


def test_same_parameters_same_init_and_every_reference_method(pair):
    model, ref = pair
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    methods = [n for n, v in vars(Transformer).items() if callable(v) and not n.startswith("__")]
    assert all(getattr(type(model), n) is getattr(Transformer, n) for n in methods if n != "forward")
    assert model.base_model is model and model.get_input_embeddings() is model.embed


def test_logits_loss_and_logits_to_keep(pair):
    model, ref = pair
    ids = torch.randint(3, 400, (2, 9), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :4] = -100
    out = model(ids, labels=labels)
    logits = ref(ids)
    assert torch.equal(out.logits, logits)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, want)
    assert torch.equal(model(ids, logits_to_keep=1).logits, logits[:, -1:])
    with pytest.raises(ValueError, match="inputs_embeds is not supported"):
        model(inputs_embeds=torch.zeros(1, 2, 64))


def test_right_padding_leaves_the_prefix_unchanged(pair):
    model, ref = pair
    ids = torch.tensor([[5, 6, 7, 8, 2, 2]])
    out = model(ids, attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]])).logits
    assert torch.equal(out[:, :4], ref(ids[:, :4])) and bool((out[:, 4:] == 0).all())


def test_from_config_honours_dtype():
    from transformers import AutoModelForCausalLM

    config = DeepseekV41Config.from_dsv4flash("tiny")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert type(model) is DeepseekV41ForCausalLM and model.embed.weight.dtype == torch.bfloat16
    assert model.head.weight.dtype == torch.float32  # the reference model keeps its head in fp32
    assert DeepseekV41ForCausalLM(config).embed.weight.dtype == torch.float32


def test_attention_backend_requests_do_not_apply(tmp_path):
    """veRL loads configs with attn_implementation=flash_attention_2; the model (own CSA2 attention) still builds."""
    from transformers import AutoConfig

    load_config("tiny").save(tmp_path / "config.json")
    config = AutoConfig.from_pretrained(tmp_path, attn_implementation="flash_attention_2")
    model = DeepseekV41ForCausalLM(config, seed=9)
    assert model.config._attn_implementation == "eager"
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(model(ids).logits, Transformer(load_config("tiny"), seed=9)(ids))
