"""`generate()` of DeepseekV41ForCausalLM (real transformers GenerationMixin) against hand-rolled loops over the
reference model: greedy and sampled, text and image prompts, left-padded batches; generate() decodes through
the CSA2 cache (`past_key_values`), equal to recomputing every step."""

from __future__ import annotations

import pytest
import torch

from dsv4flash.config import load_config
from dsv4flash.hf import DeepseekV41Config, DeepseekV41ForCausalLM
from dsv4flash.model.image import TEXT, ImageInput, expand_image_placeholders
from dsv4flash.model.transformer import Transformer

CFG = load_config("tiny")
EOS, PAD = CFG.eos_token_id, CFG.pad_token_id


@pytest.fixture(scope="module")
def models():
    """The HF model and the reference model with the same seeded weights."""
    return (DeepseekV41ForCausalLM(DeepseekV41Config.from_dsv4flash("tiny"), seed=3).eval(),
            Transformer(CFG, seed=3).eval())


def hand_rolled(ref, ids, steps, pick, token_types=None, images=None):
    """Append `steps` tokens chosen by `pick(last_logits)` with full forwards; finished rows get PAD after EOS."""
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    with torch.no_grad():
        for _ in range(steps):
            types = None if token_types is None else torch.cat(
                [token_types, torch.full((ids.shape[0], ids.shape[1] - token_types.shape[1]), TEXT)], 1)
            nxt = pick(ref(ids, types, images)[:, -1])
            nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
            done |= nxt == EOS
            ids = torch.cat([ids, nxt[:, None]], 1)
            if bool(done.all()):
                break
    return ids


def test_greedy_equals_hand_rolled_loop(models):
    model, ref = models
    ids = torch.randint(3, 400, (3, 7), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(out, hand_rolled(ref, ids, 8, lambda logits: logits.argmax(-1)))


def test_sampling_equals_hand_rolled_multinomial(models):
    model, ref = models
    ids = torch.randint(3, 400, (2, 5), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(11)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=True,
                         temperature=0.7, top_k=0, top_p=1.0)
    torch.manual_seed(11)
    want = hand_rolled(ref, ids, 6, lambda logits: torch.multinomial(torch.softmax(logits / 0.7, -1), 1)[:, 0])
    assert torch.equal(out, want)
    torch.manual_seed(12)
    other = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=True,
                           temperature=0.7, top_k=0, top_p=1.0)
    assert not torch.equal(other, out)  # it really samples


def test_greedy_on_an_image_prompt(models):
    model, ref = models
    image = ImageInput(torch.randn(9 * 9, 3 * 14 * 14, generator=torch.Generator().manual_seed(4)), (9, 9))
    ids, types = expand_image_placeholders(torch.tensor([5, 6, CFG.image_token_id, 7]), [image], CFG)
    out = model.generate(ids[None], token_types=types[None], images=[image], max_new_tokens=5, do_sample=False)
    assert torch.equal(out, hand_rolled(ref, ids[None], 5, lambda logits: logits.argmax(-1), types[None], [image]))


def test_left_padded_batch_matches_each_prompt_alone(models):
    model, _ = models
    short, long = torch.tensor([[9, 10, 11]]), torch.tensor([[20, 21, 22, 23, 24]])
    batch = torch.tensor([[PAD, PAD, 9, 10, 11], [20, 21, 22, 23, 24]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = model.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False)
    alone = [model.generate(p, max_new_tokens=4, do_sample=False) for p in (short, long)]
    assert torch.equal(out[0, 2:], alone[0][0]) and torch.equal(out[1], alone[1][0])


def test_generate_decodes_through_the_csa2_cache(models, monkeypatch):
    from dsv4flash.model.cache import DecodeCache

    model, _ = models
    ids = torch.randint(3, 400, (2, 11), generator=torch.Generator().manual_seed(5))  # past the 8-token window
    out = model(ids, use_cache=True)
    cache = out.past_key_values
    assert isinstance(cache, DecodeCache) and cache.length == 11 and model.generation_config.use_cache is True
    step = model(torch.tensor([[7], [8]]), past_key_values=cache, use_cache=True)
    full = model(torch.cat([ids, torch.tensor([[7], [8]])], 1))
    assert step.logits.shape == (2, 1, CFG.text.vocab_size) and step.past_key_values.length == 12
    assert (step.logits[:, 0] - full.logits[:, -1]).abs().max() < 1e-5
    calls = []
    decode = type(model).decode
    monkeypatch.setattr(type(model), "decode", lambda self, c, n, t=None: calls.append(n.shape) or decode(self, c, n, t))
    cached = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert calls == [(2, 1)] * 5  # one prefill, then one single-token cached step per new token
    monkeypatch.undo()
    assert torch.equal(cached, model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False))
    beams = model.generate(ids[:1], max_new_tokens=4, do_sample=False, num_beams=3)
    assert torch.equal(beams, model.generate(ids[:1], max_new_tokens=4, do_sample=False, num_beams=3,
                                             use_cache=False))
    with pytest.raises(ValueError, match="must be the DecodeCache"):
        model(ids, past_key_values=object())
    with pytest.raises(ValueError, match="padded attention_mask"):
        model(ids[:, :1], past_key_values=cache, attention_mask=torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="holes"):
        model(torch.tensor([[5, 6, 7, 8]]), attention_mask=torch.tensor([[1, 0, 1, 1]]))
