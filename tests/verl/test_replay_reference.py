"""Text-only routing replay on the reference tiny model (with an image): compact recording -> expanded replay."""

from __future__ import annotations

import pytest
import torch

from dsv4flash.model.image import ImageInput, expand_image_placeholders, image_token_types, llm_grid_hw
from dsv4flash.replay import ImageSpanLayout, expand_routes, r3_batch_keys, r3_replay_mask, row_map, text_replay_mask
from dsv4flash.replay.reference import record_routes, replay_routes

pytestmark = pytest.mark.parity


def _image(cfg, grid=(6, 9), seed=0) -> ImageInput:
    p = cfg.vision.patch_size
    gen = torch.Generator().manual_seed(seed)
    return ImageInput(torch.randn(grid[0] * grid[1], 3 * p * p, generator=gen) * 0.5, grid)


@pytest.fixture(scope="module")
def rollout():
    """A rollout on the tiny VL model: compact prompt with two images, expanded run, recorded routes."""
    from dsv4flash.model.transformer import Transformer

    model = Transformer("tiny", seed=0).eval()
    cfg = model.cfg
    gen = torch.Generator().manual_seed(5)
    compact = torch.randint(3, 400, (30,), generator=gen)
    compact[4] = cfg.image_token_id
    compact[5] = cfg.image_token_id  # two adjacent images: the hard case for naive span detection
    compact[17] = cfg.image_token_id
    images = [_image(cfg, (6, 9), 1), _image(cfg, (3, 3), 2), _image(cfg, (6, 6), 3)]
    ids, types = expand_image_placeholders(compact, images, cfg)
    with torch.no_grad(), record_routes(model) as records:
        logits = model(ids[None], types[None], images)
    routes_e = torch.stack(records, dim=1)  # [S_e, L, k]
    spans = [image_token_types(*llm_grid_hw(img.grid_hw, cfg.vision.downsample_ratio)).numel() for img in images]
    layout = ImageSpanLayout.from_compact_ids(compact, cfg.image_token_id, spans)
    return dict(model=model, cfg=cfg, compact=compact, ids=ids, types=types, images=images, layout=layout,
                routes_e=routes_e, logits=logits[0])


def _compact_recording(r):
    """What vLLM hands back: one row per compact token; the placeholder rows hold routes of no use to training."""
    lay = r["layout"]
    routes = r["routes_e"][lay.expanded_rows()].clone()
    routes[~lay.compact_text_rows()] = torch.randint(0, 8, routes[~lay.compact_text_rows()].shape)
    return routes


def _perturbed_text_bias(model, seed=9):
    """The trainer after an expert-bias update: text selection bias moved, weights (and bias_vl) unchanged."""
    gen = torch.Generator().manual_seed(seed)
    saved = []
    with torch.no_grad():
        for layer in model.layers:
            saved.append(layer.ffn.gate.bias.clone())
            layer.ffn.gate.bias.add_(torch.randn(layer.ffn.gate.bias.shape, generator=gen) * 3.0)
    return saved


def _restore(model, saved):
    with torch.no_grad():
        for layer, bias in zip(model.layers, saved):
            layer.ffn.gate.bias.copy_(bias)


def test_layout_round_trips_with_token_types(rollout):
    lay = rollout["layout"]
    assert lay.expanded_len == rollout["ids"].numel()
    assert ImageSpanLayout.from_token_types(rollout["types"]) == lay
    torch.testing.assert_close(lay.image_rows(), rollout["types"] >= 0)
    # text rows keep their token ids through the map
    text = lay.compact_text_rows()
    torch.testing.assert_close(rollout["ids"][lay.expanded_rows()[text]], rollout["compact"][text])
    assert ImageSpanLayout.from_llm_grids(rollout["compact"], rollout["cfg"].image_token_id,
                                          [(2, 3), (1, 1), (2, 2)]) == lay


def test_text_only_replay_is_exact_and_image_rows_route_natively(rollout):
    model, lay = rollout["model"], rollout["layout"]
    routes, replayed = expand_routes(_compact_recording(rollout), lay)
    mask = text_replay_mask(lay, replayed)
    text = ~lay.image_rows()
    saved = _perturbed_text_bias(model)
    try:
        with torch.no_grad(), record_routes(model) as native_rec:
            native_logits = model(rollout["ids"][None], rollout["types"][None], rollout["images"])[0]
        with torch.no_grad(), replay_routes(model, routes, mask) as trace:
            replay_logits = model(rollout["ids"][None], rollout["types"][None], rollout["images"])[0]
    finally:
        _restore(model, saved)
    native = torch.stack(native_rec, dim=1)
    used = torch.stack(trace.used, dim=1)
    in_run_native = torch.stack(trace.native, dim=1)
    # the perturbation really changes text routing, so replay has something to do
    assert not torch.equal(native[text], rollout["routes_e"][text])
    # replayed text rows are the recorded ones, image rows are the trainer's native (bias_vl) choice
    torch.testing.assert_close(used[text], rollout["routes_e"][text], rtol=0, atol=0)
    torch.testing.assert_close(used[~text], in_run_native[~text], rtol=0, atol=0)
    torch.testing.assert_close(used[~text], rollout["routes_e"][~text], rtol=0, atol=0)
    # log-prob mismatch on text tokens is exactly zero in fp32; without replay it is not
    lp_roll = torch.log_softmax(rollout["logits"], -1)
    lp_replay = torch.log_softmax(replay_logits, -1)
    lp_native = torch.log_softmax(native_logits, -1)
    assert (lp_replay[text] - lp_roll[text]).abs().max().item() == 0.0
    assert (lp_native[text] - lp_roll[text]).abs().max().item() > 1e-4


def test_replaying_placeholder_rows_onto_spans_breaks_parity(rollout):
    """Negative control: a naive length-padded alignment (what position-blind replay does) is wrong."""
    model, lay = rollout["model"], rollout["layout"]
    compact_routes = _compact_recording(rollout)
    naive = torch.zeros_like(rollout["routes_e"])
    naive[: compact_routes.shape[0]] = compact_routes
    with torch.no_grad(), replay_routes(model, naive, torch.ones(lay.expanded_len, dtype=torch.bool)):
        logits = model(rollout["ids"][None], rollout["types"][None], rollout["images"])[0]
    text = ~lay.image_rows()
    assert (torch.log_softmax(logits, -1)[text] - torch.log_softmax(rollout["logits"], -1)[text]).abs().max() > 1e-4


def test_row_maps_for_compact_expanded_and_short_recordings(rollout):
    lay = rollout["layout"]
    full = row_map(lay, lay.compact_len)
    assert (full[~lay.compact_text_rows()] == -1).all()
    assert torch.equal(row_map(lay, lay.compact_len - 1), full[:-1])  # no route for the final token
    expanded = row_map(lay, lay.expanded_len)
    assert (expanded[lay.image_rows()] == -1).all() and (expanded[~lay.image_rows()] >= 0).all()
    with pytest.raises(ValueError, match="expected the compact length"):
        row_map(lay, lay.compact_len + 1)
    mask = r3_replay_mask(lay, response_len=4, route_rows=lay.compact_len - 1)
    assert not mask[-1] and not mask[lay.image_rows()].any()
    assert not r3_replay_mask(lay, response_len=0, route_rows=lay.compact_len).any()
    keys = r3_batch_keys([lay, ImageSpanLayout(5, (), ())], [lay.compact_len, 5])
    assert keys["r3_row_map"].is_nested and keys["r3_native_rows"].is_nested
    assert [t.numel() for t in keys["r3_native_rows"].unbind()] == [lay.expanded_len, 5]


def test_layout_errors_name_the_problem():
    with pytest.raises(ValueError, match="2 image placeholders"):
        ImageSpanLayout.from_compact_ids(torch.tensor([1, 7, 7, 2]), 7, [4])
    with pytest.raises(ValueError, match="distinct, ascending"):
        ImageSpanLayout(4, (2, 1), (3, 3))
    with pytest.raises(ValueError, match="do not pair up"):
        ImageSpanLayout.from_token_types(torch.tensor([-1, 0, 1, 1, -1]))
