"""Vision tower, aligner, preprocessing and image spans (§7, §8.3, §14)."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv4flash.config import load_config
from dsv4flash.model.image import (
    IMAGE, IMAGE_END, IMAGE_NEWLINE, IMAGE_START, TEXT, ImageInput, expand_image_placeholders,
    fill_image_embeddings, image_token_types, num_image_tokens, pad_prompts, plan_image_grid, prepare_vl_inputs,
    preprocess_image,
)
from dsv4flash.model.vision import Aligner, VisionTower, apply_rope2d, encode_images, rope2d_angles

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="module")
def tiny():
    return load_config("tiny")


@pytest.fixture(scope="module")
def towers(tiny):
    torch.manual_seed(0)
    return VisionTower(tiny), Aligner(tiny)


def _image(h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# ---- spans ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hw, grid, llm, span", [((42, 42), (3, 3), (1, 1), 4), ((42, 84), (3, 6), (1, 2), 5)])
def test_span_lengths_of_section_14(tiny, towers, hw, grid, llm, span):
    img = preprocess_image(_image(*hw), tiny)
    assert img.grid_hw == grid and img.patches.shape == (grid[0] * grid[1], 588)
    assert num_image_tokens(*llm) == span
    ids, types = expand_image_placeholders([tiny.image_token_id], [img], tiny)
    assert ids.tolist() == [tiny.image_token_id] * span
    assert types.tolist() == image_token_types(*llm).tolist()
    rows = encode_images(*towers, [img])[0]
    assert rows.shape == (llm[0] * llm[1], tiny.text.hidden_size) and rows.shape[0] == int((types == IMAGE).sum())


def test_span_layout_and_expansion_of_several_images(tiny):
    a = ImageInput(torch.zeros(4 * 7, 588), (4, 7))  # -> H' 2, W' 3
    b = ImageInput(torch.zeros(9, 588), (3, 3))
    assert image_token_types(2, 3).tolist() == [0, 1, 1, 1, 2, 1, 1, 1, 2, 3]
    ids, types = expand_image_placeholders(torch.tensor([5, 500, 6, 7, 500]), [a, b], tiny)
    assert ids.tolist() == [5] + [500] * 10 + [6, 7] + [500] * 4
    assert types.tolist() == [TEXT] + image_token_types(2, 3).tolist() + [TEXT, TEXT] + [0, 1, 2, 3]


def test_placeholder_count_mismatch_names_both_counts(tiny):
    img = ImageInput(torch.zeros(9, 588), (3, 3))
    with pytest.raises(ValueError, match=r"2 image placeholder tokens \(image_token_id=500\) but 1 images"):
        expand_image_placeholders([500, 1, 500], [img], tiny)
    with pytest.raises(ValueError, match="0 image placeholder tokens.*but 1 images"):
        expand_image_placeholders([1, 2], [img], tiny)
    novision = tiny.replace_vision(num_hidden_layers=0)
    with pytest.raises(ValueError, match="no vision tower"):
        expand_image_placeholders([500], [img], novision)
    with pytest.raises(ValueError, match="patches must be"):
        ImageInput(torch.zeros(8, 588), (3, 3))


# ---- preprocessing ----------------------------------------------------------------------------------

def test_patch_order_is_row_major_and_channel_major(tiny):
    p = 14
    n_h, n_w = 3, 4
    pixels = np.zeros((n_h * p, n_w * p, 3), dtype=np.uint8)
    for r in range(n_h):
        for c in range(n_w):
            for ch in range(3):
                pixels[r * p:(r + 1) * p, c * p:(c + 1) * p, ch] = 10 * (r * n_w + c) + 3 * ch
    img = preprocess_image(pixels, tiny, dtype=torch.float32)  # 42 x 56 ≥ min_pixels: no resize
    assert img.grid_hw == (n_h, n_w)
    for r in range(n_h):
        for c in range(n_w):
            patch = img.patches[r * n_w + c].reshape(3, p, p)
            for ch in range(3):
                want = (10 * (r * n_w + c) + 3 * ch) / 255 * 2 - 1
                torch.testing.assert_close(patch[ch], torch.full((p, p), want))


def test_upscale_round_up_and_gray_padding(tiny):
    # 20x30 (600 px < 1764): scale by sqrt(1764/600), truncate -> 34 x 51, round up to 42 x 56.
    plan = plan_image_grid(30, 20, tiny)
    assert (plan.height, plan.width) == (42, 56)
    # a wide 84x30 strip fits 84x42 by padding 6 gray rows above and below
    strip = np.full((30, 84, 3), 255, dtype=np.uint8)
    img = preprocess_image(strip, tiny, dtype=torch.float32)
    assert img.grid_hw == (3, 6)
    grid = img.patches.reshape(3, 6, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 42, 84)
    gray = 127 / 255 * 2 - 1
    assert torch.allclose(grid[:, :6], torch.tensor(gray)) and torch.allclose(grid[:, -6:], torch.tensor(gray))
    assert torch.allclose(grid[:, 8:34], torch.tensor(1.0))


def test_token_budget_shrinks_large_and_extreme_images(tiny):
    flash = load_config("flash")
    for cfg in (tiny, flash):
        for w, h in [(4000, 3000), (300, 5000), (10000, 60), (60, 10000), (1, 1)]:
            plan = plan_image_grid(w, h, cfg)
            assert num_image_tokens(plan.n_llm_h, plan.n_llm_w) <= cfg.vision.max_image_tokens
            assert plan.height % 14 == 0 and plan.width % 14 == 0
    # a 640x480 photo at release settings: 644 x 490 pixels, 12 x 16 tokens, 206-token span
    assert plan_image_grid(640, 480, flash) == (12, 16, 490, 644)


def test_input_kinds_agree(tiny, tmp_path):
    from PIL import Image

    pixels = _image(42, 70, seed=3)
    path = tmp_path / "img.png"
    Image.fromarray(pixels).save(path)
    outs = [preprocess_image(x, tiny) for x in (pixels, torch.from_numpy(pixels).permute(2, 0, 1),
                                                Image.fromarray(pixels), str(path), path.read_bytes())]
    assert all(o.patches.dtype == torch.bfloat16 for o in outs)
    assert all(torch.equal(outs[0].patches, o.patches) and o.grid_hw == outs[0].grid_hw for o in outs)
    with pytest.raises(ValueError, match="uint8"):
        preprocess_image(pixels.astype(np.float32), tiny)


# ---- 2D RoPE ----------------------------------------------------------------------------------------

def test_rope2d_angles_layout():
    head_dim, theta = 16, 10000.0
    angles = rope2d_angles(3, 5, head_dim, theta)
    assert angles.shape == (15, 8)
    inv = [1.0 / theta ** (2 * k / 8) for k in range(4)]
    for h in range(3):
        for w in range(5):
            want = [h * f for f in inv] + [w * f for f in inv]
            torch.testing.assert_close(angles[h * 5 + w], torch.tensor(want))


def test_rope2d_rotates_halves_and_keeps_relative_positions():
    gen = torch.Generator().manual_seed(0)
    head_dim = 16
    angles = rope2d_angles(6, 7, head_dim, 10000.0)
    x = torch.randn(42, 2, head_dim, generator=gen)
    out = apply_rope2d(x, angles)
    # rotate-half: lane i pairs with lane i + 8 under angle i
    i, n = 3, 20
    a, b = x[n, :, i], x[n, :, i + 8]
    cos, sin = math.cos(angles[n, i]), math.sin(angles[n, i])
    torch.testing.assert_close(out[n, :, i], a * cos - b * sin)
    torch.testing.assert_close(out[n, :, i + 8], b * cos + a * sin)
    assert torch.equal(apply_rope2d(x[:1], angles[:1]), x[:1])  # position (0, 0) is the identity
    # q·k depends only on the (dh, dw) offset
    q, k = torch.randn(head_dim, generator=gen), torch.randn(head_dim, generator=gen)

    def score(pq, pk):
        rq = apply_rope2d(q.view(1, 1, -1), angles[pq[0] * 7 + pq[1]].view(1, -1))
        rk = apply_rope2d(k.view(1, 1, -1), angles[pk[0] * 7 + pk[1]].view(1, -1))
        return float((rq * rk).sum())

    base = score((1, 2), (3, 1))
    for shift in [(1, 0), (0, 3), (2, 4)]:
        moved = score((1 + shift[0], 2 + shift[1]), (3 + shift[0], 1 + shift[1]))
        assert math.isclose(base, moved, rel_tol=1e-4, abs_tol=1e-5)
    assert not math.isclose(base, score((1, 2), (1, 3)), rel_tol=1e-3)


# ---- tower and aligner ------------------------------------------------------------------------------

def test_attention_is_bidirectional_within_one_image(tiny, towers):
    tower, _ = towers
    gen = torch.Generator().manual_seed(1)
    patches = torch.randn(12, 588, generator=gen)
    out = tower(patches, (3, 4))
    changed = patches.clone()
    changed[-1] += 1.0
    out2 = tower(changed, (3, 4))
    assert (out[0] - out2[0]).abs().max() > 1e-6  # a later patch changes the first patch's output
    # images never attend to each other
    other = ImageInput(torch.randn(9, 588, generator=gen), (3, 3))
    both = tower.forward_images([ImageInput(patches, (3, 4)), other])
    torch.testing.assert_close(both[0], out)
    torch.testing.assert_close(both[1], tower(other.patches, (3, 3)))


def test_tower_matches_an_independent_forward(tiny, towers):
    tower, _ = towers
    gen = torch.Generator().manual_seed(2)
    patches = torch.randn(6, 588, generator=gen)
    n_h, n_w = 2, 3

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    x = patches @ tower.patch_embed.proj.weight.t() + tower.patch_embed.proj.bias
    angles = rope2d_angles(n_h, n_w, 16, 10000.0)
    for blk in tower.blocks:
        y = rms(x, blk.norm1.weight)
        qkv = y @ blk.attn.wqkv.weight.t() + blk.attn.wqkv.bias
        q, k, v = (t.reshape(6, 2, 16) for t in qkv.split(32, -1))
        q, k = apply_rope2d(q, angles), apply_rope2d(k, angles)
        att = torch.softmax(torch.einsum("nhd,mhd->hnm", q, k) / 4.0, -1)  # scale 16^-0.5
        o = torch.einsum("hnm,mhd->nhd", att, v).reshape(6, 32)
        x = x + o @ blk.attn.wo.weight.t() + blk.attn.wo.bias
        g, u = (rms(x, blk.norm2.weight) @ blk.mlp.w1.weight.t()).split(64, -1)
        x = x + (torch.nn.functional.silu(g) * u) @ blk.mlp.w2.weight.t()
    torch.testing.assert_close(tower(patches, (n_h, n_w)), rms(x, tower.norm.weight), rtol=1e-5, atol=1e-5)


def test_aligner_unfold_order_matches_loop_reference(tiny, towers):
    _, aligner = towers
    n_h, n_w, c = 4, 5, 32  # pads to 6 x 6 -> 2 x 2 tokens
    feats = torch.randn(n_h * n_w, c, generator=torch.Generator().manual_seed(3))
    cells = aligner.merge(feats, (n_h, n_w))
    assert cells.shape == (4, c * 9)
    want = torch.zeros(4, c * 9)
    for gi in range(2):
        for gj in range(2):
            for ch in range(c):
                for kh in range(3):
                    for kw in range(3):
                        r, col = 3 * gi + kh, 3 * gj + kw
                        if r < n_h and col < n_w:
                            want[gi * 2 + gj, ch * 9 + kh * 3 + kw] = feats[r * n_w + col, ch]
    assert torch.equal(cells, want)
    # forward = w2(exact-erf GELU(w1(cells))); large inputs so the tanh approximation would show
    feats = feats * 20
    pre = aligner.merge(feats, (n_h, n_w)) @ aligner.w1.weight.t() + aligner.w1.bias
    gelu = 0.5 * pre * (1 + torch.erf(pre / math.sqrt(2)))
    torch.testing.assert_close(aligner(feats, (n_h, n_w)), gelu @ aligner.w2.weight.t() + aligner.w2.bias,
                               rtol=1e-5, atol=1e-6)


def test_parameter_names_shapes_and_norm_dtype(tiny):
    tower, aligner = VisionTower(tiny, dtype=torch.bfloat16), Aligner(tiny, dtype=torch.bfloat16)
    mine = {f"vision.{k}": tuple(v.shape) for k, v in tower.state_dict().items()}
    mine.update({f"aligner.{k}": tuple(v.shape) for k, v in aligner.state_dict().items()})
    census = {}
    for line in (DATA / "tiny_tensors.tsv").read_text().splitlines():
        name, _dtype, shape = line.split("\t")
        if name.startswith(("vision.", "aligner.")):
            census[name] = tuple(int(s) for s in shape.split(","))
    assert mine == census
    for name, p in tower.named_parameters():
        assert p.dtype == (torch.float32 if "norm" in name else torch.bfloat16), name
    patches = preprocess_image(_image(42, 42), tiny).patches
    assert aligner(tower(patches, (3, 3)), (3, 3)).dtype == torch.bfloat16


def test_flash_vision_builds_on_meta_and_matches_release_census():
    cfg = load_config("flash")
    with torch.device("meta"):
        tower, aligner = VisionTower(cfg), Aligner(cfg)
    assert all(p.is_meta for p in [*tower.parameters(), *aligner.parameters()])
    mine = {f"vision.{k}": tuple(v.shape) for k, v in tower.state_dict().items()}
    mine.update({f"aligner.{k}": tuple(v.shape) for k, v in aligner.state_dict().items()})
    census = {}
    with gzip.open(DATA / "release_tensors.tsv.gz", "rt") as fh:
        for line in fh:
            name, _dtype, shape = line.rstrip("\n").split("\t")
            if name.startswith(("vision.", "aligner.")):
                census[name] = tuple(int(s) for s in shape.split(","))
    assert len(census) == 263 and mine == census


# ---- filling the embedding --------------------------------------------------------------------------

def test_fill_image_embeddings_places_rows_and_delimiters(tiny):
    d = 8
    a = ImageInput(torch.zeros(4 * 7, 588), (4, 7))  # 2 x 3 tokens
    b = ImageInput(torch.zeros(9, 588), (3, 3))  # 1 x 1
    p0 = expand_image_placeholders([1, 500, 2], [a], tiny)
    p1 = expand_image_placeholders([500, 3, 4, 5], [b], tiny)
    batch = pad_prompts([p0, p1], pad_token_id=tiny.pad_token_id, pad_to_multiple_of=8)
    assert batch.input_ids.shape == (2, 16)
    assert batch.valid_mask.sum(1).tolist() == [12, 7] and batch.input_ids[1, 7:].eq(tiny.pad_token_id).all()
    assert batch.token_types[1, 7:].eq(TEXT).all()
    h = torch.randn(2, 16, d)
    rows = [torch.arange(6 * d, dtype=torch.float32).reshape(6, d) + 1000, torch.full((1, d), -7.0)]
    start, newline, end = (torch.full((d,), v, requires_grad=True) for v in (0.5, 0.25, 0.125))
    out = fill_image_embeddings(h, batch.token_types, rows, start, newline, end)
    types = batch.token_types
    assert torch.equal(out[types == TEXT], h[types == TEXT])
    assert torch.equal(out[0][types[0] == IMAGE], rows[0])  # reading order
    assert torch.equal(out[1][types[1] == IMAGE], rows[1])
    for code, vec in ((IMAGE_START, start), (IMAGE_NEWLINE, newline), (IMAGE_END, end)):
        assert torch.equal(out[types == code], vec.detach().expand(int((types == code).sum()), d))
    out.sum().backward()
    assert start.grad.eq(2).all() and newline.grad.eq(3).all() and end.grad.eq(2).all()
    # the unbatched form gives the same row
    single = fill_image_embeddings(h[0, :12], p0[1], rows[:1], start, newline, end)
    assert torch.equal(single, out[0, :12])


def test_fill_image_embeddings_rejects_mismatches(tiny):
    ids, types = expand_image_placeholders([500], [ImageInput(torch.zeros(9, 588), (3, 3))], tiny)
    h, vec = torch.zeros(4, 8), torch.zeros(8)
    with pytest.raises(ValueError, match="1 image spans but 2 aligner outputs"):
        fill_image_embeddings(h, types, [torch.zeros(1, 8)] * 2, vec, vec, vec)
    with pytest.raises(ValueError, match=r"span 0 has 1 IMAGE slots of width 8, but its aligner output is \[2, 8\]"):
        fill_image_embeddings(h, types, [torch.zeros(2, 8)], vec, vec, vec)
    with pytest.raises(ValueError, match="disagree"):
        fill_image_embeddings(torch.zeros(5, 8), types, [torch.zeros(1, 8)], vec, vec, vec)


def test_prepare_vl_inputs_end_to_end(tiny, towers):
    ids, types, images = prepare_vl_inputs([9, 500, 10], [_image(42, 84)], tiny)
    assert types.tolist() == [TEXT, 0, 1, 1, 2, 3, TEXT] and ids.tolist() == [9] + [500] * 5 + [10]
    rows = encode_images(*towers, images)
    h = torch.zeros(7, tiny.text.hidden_size)
    vec = torch.ones(tiny.text.hidden_size)
    out = fill_image_embeddings(h, types, rows, vec, 2 * vec, 3 * vec)
    torch.testing.assert_close(out[2:4], rows[0])


@pytest.mark.gpu
def test_cuda_tower_and_aligner_match_cpu(tiny):
    torch.manual_seed(4)
    tower, aligner = VisionTower(tiny), Aligner(tiny)
    img = preprocess_image(_image(42, 84, seed=5), tiny, dtype=torch.float32)
    want = encode_images(tower, aligner, [img])[0]
    got = encode_images(tower.cuda(), aligner.cuda(), [img])[0]  # patches follow the tower's device
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
