"""The V4.1 HF processor (`dsv4flash.hf.processing`) through transformers' real `AutoProcessor`: loaded offline
from a dsv4flash base directory and from its own `save_pretrained`, it gives exactly the ids, token types and
patches of the reference preparation (`dsv4flash.model.image.prepare_vl_inputs`) for geometry-task prompts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dsv4flash  # noqa: F401  (registers the V4.1 classes lazily)
from dsv4flash.model.image import prepare_vl_inputs
from dsv4flash.tasks import TaskTokenizer, build_task


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_cfg):
    from dsv4flash.engine.model_io import save_base
    from dsv4flash.model.transformer import Transformer

    root = tmp_path_factory.mktemp("processor")
    return save_base(Transformer(tiny_cfg, seed=0), tiny_cfg, TaskTokenizer(tiny_cfg), root / "base", {"kind": "test"})


def _examples(n: int):
    task, rng = build_task("geometry"), np.random.default_rng(3)
    return [task.sample(rng) for _ in range(n)]


def _reference(ex, cfg):
    tok = TaskTokenizer(cfg)
    return prepare_vl_inputs([tok.bos_id] + tok.encode(ex.prompt), list(ex.images), cfg, dtype=torch.float32)


def _messages(ex):
    # veRL's RLHFDataset._build_messages form: the prompt split at <image> into text and image parts.
    before, after = ex.prompt.split("<image>")
    parts = [{"type": "text", "text": before}, {"type": "image"}] + ([{"type": "text", "text": after}] if after else [])
    return [{"role": "user", "content": parts}]


def test_auto_processor_on_a_base_equals_the_reference_preparation(base, tiny_cfg):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(base))
    assert type(proc).__name__ == "DeepseekV41Processor"
    for ex in _examples(4):
        text = proc.apply_chat_template(_messages(ex), tokenize=False, add_generation_prompt=True)
        out = proc(text=[text], images=list(ex.images), return_tensors="pt")
        ids, types, images = _reference(ex, tiny_cfg)
        assert torch.equal(out["input_ids"][0], ids) and torch.equal(out["token_types"][0], types)
        assert torch.equal(out["pixel_values"], torch.cat([i.patches for i in images]))
        assert out["image_grid_hw"].tolist() == [list(i.grid_hw) for i in images]
        assert out["attention_mask"].sum().item() == ids.numel()


def test_a_batch_pads_and_concatenates_images_in_order(base, tiny_cfg):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(base))
    exs = _examples(3)
    texts = [proc.apply_chat_template(_messages(ex), tokenize=False) for ex in exs]
    out = proc(text=texts, images=[list(ex.images) for ex in exs], padding=True)
    refs = [_reference(ex, tiny_cfg) for ex in exs]
    for row, (ids, types, _) in enumerate(refs):
        n = ids.numel()
        assert torch.equal(out["input_ids"][row, :n], ids) and torch.equal(out["token_types"][row, :n], types)
        assert (out["input_ids"][row, n:] == proc.tokenizer.pad_token_id).all()
        assert out["attention_mask"][row].tolist() == [1] * n + [0] * (out["input_ids"].shape[1] - n)
    assert torch.equal(out["pixel_values"], torch.cat([i.patches for _, _, imgs in refs for i in imgs]))


def test_save_pretrained_round_trips_through_auto_processor(base, tmp_path):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(base))
    proc.save_pretrained(str(tmp_path / "saved"))
    again = AutoProcessor.from_pretrained(str(tmp_path / "saved"))
    ex = _examples(1)[0]
    text = proc.apply_chat_template(_messages(ex), tokenize=False)
    a, b = proc(text=text, images=list(ex.images)), again(text=text, images=list(ex.images))
    assert type(again).__name__ == "DeepseekV41Processor" and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_placeholder_and_image_counts_must_agree(base):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(base))
    ex = _examples(1)[0]
    with pytest.raises(ValueError, match="2 images given but the text has 1 <image> placeholders"):
        proc(text="q : how many shapes ? <image>", images=[ex.images[0], ex.images[0]])
    with pytest.raises(ValueError, match="more <image> placeholders than the 0 images"):
        proc(text="q : how many shapes ? <image>")
    with pytest.raises(ValueError, match="videos are not supported"):
        proc(text="q", videos=[ex.images[0]])


def test_processor_output_drives_forward_and_generate_like_the_reference_path(base, tiny_cfg):
    """The standard call, `model.generate(**processor(text=..., images=...))`: the same logits as the reference
    model on `prepare_vl_inputs`, and the same greedy and sampled tokens as `generate(images=...)` on them
    (tests/hf/test_generate.py checks that form against hand-rolled loops over the reference model)."""
    from transformers import AutoModelForCausalLM, AutoProcessor

    from dsv4flash.engine.model_io import load_base_weights
    from dsv4flash.model.transformer import Transformer

    proc = AutoProcessor.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    ref = Transformer(tiny_cfg, seed=None)
    load_base_weights(ref, base)
    ex = _examples(1)[0]
    inputs = proc(text=proc.apply_chat_template(_messages(ex), tokenize=False, add_generation_prompt=True),
                  images=list(ex.images), return_tensors="pt")
    ids, types, images = _reference(ex, tiny_cfg)
    own = {"input_ids": ids[None], "token_types": types[None], "images": images}
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, ref.eval()(ids[None], types[None], images))
    greedy = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert torch.equal(greedy, model.generate(**own, max_new_tokens=6, do_sample=False))
    sampling = dict(max_new_tokens=6, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    torch.manual_seed(7)
    sampled = model.generate(**inputs, **sampling)
    torch.manual_seed(7)
    assert torch.equal(sampled, model.generate(**own, **sampling))
    with pytest.raises(ValueError, match="pixel_values and image_grid_hw come together"):
        model(inputs["input_ids"], token_types=inputs["token_types"], pixel_values=inputs["pixel_values"])
    with pytest.raises(ValueError, match="not both"):
        model(**inputs, images=images)
