"""Engram: hashing against a per-token reference, row ranges, gate numerics, gradients, meta build (§6)."""

from __future__ import annotations

import copy
import gzip
import math
from pathlib import Path

import pytest
import torch

from dsv4flash.config import load_config
from dsv4flash.model.engram import DEAD, Engram, EngramHasher, build_compressed_token_map, engram_gate

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="module")
def tiny():
    return load_config("tiny")


def reference_row_ids(cfg, layer: int, comp: list[int], pad_id: int, seg_start: list[int] | None = None):
    """Per-token, per-column hash with Python ints, written straight from §6 (slow, obviously correct)."""
    lay = cfg.engram_layouts[layer]
    max_n = cfg.text.engram_max_ngram_size
    out = []
    for t in range(len(comp)):
        start = 0 if seg_start is None else seg_start[t]
        vals, blocked = [], False
        for s in range(max_n):
            if t - s < start or comp[t - s] == DEAD:
                blocked = True
            vals.append(pad_id if blocked else comp[t - s])
        row, r = [], vals[0] * lay.multipliers[0]
        for n in range(2, max_n + 1):
            r ^= vals[n - 1] * lay.multipliers[n - 1]
            assert 0 <= r < 2**63  # the multiplier bound: no int64 wrap
            for h, prime in enumerate(lay.primes[n - 2]):
                row.append(r % prime + lay.offsets[n - 2][h])
        out.append(row)
    return out


def random_prompt(gen, bsz, seqlen, vocab):
    ids = torch.randint(0, vocab, (bsz, seqlen), generator=gen)
    types = torch.full((bsz, seqlen), -1)
    types[0, 0] = 0  # DEAD at the sequence start
    types[0, 5:9] = torch.tensor([0, 1, 2, 3])  # an image span
    types[1, 3] = 1  # a one-token DEAD island
    types[1, seqlen - 1] = 3  # DEAD at the last position
    types[2, 10:13] = 1
    return ids, types


def test_hash_matches_per_token_reference(tiny):
    gen = torch.Generator().manual_seed(0)
    hasher = EngramHasher(tiny)
    ids, types = random_prompt(gen, 3, 40, tiny.text.vocab_size)
    got = hasher(ids, types)
    assert len(got) == len(tiny.text.engram_layer_ids)
    for layer, rows in enumerate(got):
        assert rows.dtype == torch.int64 and rows.shape == (3, 40, 6)
        for b in range(3):
            comp = [DEAD if int(types[b, t]) >= 0 else int(ids[b, t]) for t in range(40)]
            want = reference_row_ids(tiny, layer, comp, hasher.pad_id)
            assert rows[b].tolist() == want


def test_dead_token_hashes_four_pads_and_blocks_lookback(tiny):
    hasher = EngramHasher(tiny)
    ids = torch.tensor([[7, 8, 9, 10, 11, 12, 13]])
    types = torch.tensor([[-1, -1, 1, -1, -1, -1, -1]])
    rows = hasher(ids, types)[0][0]
    # Position 2 is DEAD: its own value and everything behind it is pad, exactly like a lone pad token
    # at the sequence start would hash (pad, pad, pad, pad).
    pad_only = hasher(torch.tensor([[tiny.text.engram_pad_token_id]]), None)[0][0, 0]
    assert rows[2].tolist() == pad_only.tolist()
    # Position 3 looks back across the DEAD token: same hash as token 10 at the very start of a sequence.
    fresh = hasher(torch.tensor([[10]]), None)[0][0, 0]
    assert rows[3].tolist() == fresh.tolist()
    # Without the DEAD token the look-back reaches 9, 8, 7 and the hash differs.
    assert hasher(ids, None)[0][0, 3].tolist() != fresh.tolist()


def test_row_ids_inside_their_order_head_ranges(tiny):
    gen = torch.Generator().manual_seed(1)
    hasher = EngramHasher(tiny)
    ids, types = random_prompt(gen, 3, 64, tiny.text.vocab_size)
    for layer, rows in enumerate(hasher(ids, types)):
        lay = tiny.engram_layouts[layer]
        flat_p = [p for order in lay.primes for p in order]
        flat_o = [o for order in lay.offsets for o in order]
        for col, (prime, off) in enumerate(zip(flat_p, flat_o)):
            col_ids = rows[..., col]
            assert int(col_ids.min()) >= off and int(col_ids.max()) < off + prime
        # ranges tile the table exactly
        assert flat_o[0] == 0 and all(flat_o[i] + flat_p[i] == flat_o[i + 1] for i in range(len(flat_p) - 1))
        assert flat_o[-1] + flat_p[-1] == lay.num_rows


@pytest.mark.parametrize("flavour", ["tiny", "flash"])
def test_table_rows_equal_sum_of_primes(flavour):
    cfg = load_config(flavour)
    for idx, lay in enumerate(cfg.engram_layouts):
        assert lay.num_rows == sum(sum(p) for p in lay.primes) == cfg.text.engram_num_embeddings[idx]
        module = Engram(cfg, idx, device="meta")
        assert module.embed.weight.shape == (lay.num_rows, cfg.text.engram_head_dim)


def test_flash_primes_and_multipliers_are_the_release_values():
    cfg = load_config("flash")
    l1, l14 = cfg.engram_layouts
    assert (l1.primes[0][0], l1.primes[-1][-1], l14.primes[0][0], l14.primes[-1][-1]) == (
        16000057, 16000463, 16000477, 16000889)
    assert l1.multipliers == (76632096046245, 4839876093313, 35959672319349, 73987337458391)
    assert l14.multipliers == (67716810739261, 51510806800915, 30921347202721, 82619226485591)
    bound = (2**63 - 1) // cfg.text.engram_compressed_vocab_size
    assert all(m % 2 == 1 and m <= bound for lay in cfg.engram_layouts for m in lay.multipliers)


def test_packed_documents_do_not_share_ngrams(tiny):
    hasher = EngramHasher(tiny)
    ids = torch.tensor([[11, 12, 13, 14, 21, 22, 23]])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    packed = hasher(ids, None, position_ids=pos)[1][0]
    first, second = hasher(ids[:, :4])[1][0], hasher(ids[:, 4:])[1][0]
    assert packed.tolist() == first.tolist() + second.tolist()
    seg = [0, 0, 0, 0, 4, 4, 4]
    assert packed.tolist() == reference_row_ids(tiny, 1, ids[0].tolist(), hasher.pad_id, seg)


def test_compressed_token_map_is_required_and_used(tiny):
    cfg = tiny.replace_text(engram_compressed_vocab_size=100)
    hasher = EngramHasher(cfg)
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match="set_token_map"):
        hasher(ids)
    with pytest.raises(ValueError, match="99 distinct compressed ids.*is 100"):
        hasher.set_token_map(torch.arange(512) % 99)
    with pytest.raises(ValueError, match=r"\[0, engram_compressed_vocab_size=100\)"):
        hasher.set_token_map(torch.arange(512) % 101)
    tmap = torch.randperm(512, generator=torch.Generator().manual_seed(3)) % 100
    hasher.set_token_map(tmap)
    assert hasher.pad_id == int(tmap[cfg.text.engram_pad_token_id])
    got = hasher(ids)[0][0].tolist()
    assert got == reference_row_ids(cfg, 0, tmap[ids[0]].tolist(), hasher.pad_id)
    # the multipliers follow the compressed vocab size, so identity-map hashes differ
    assert got != hasher.__class__(tiny)(ids)[0][0].tolist()


def test_hasher_buffers_survive_meta_build_and_to_empty(tiny):
    ref = EngramHasher(tiny)
    with torch.device("meta"):
        hasher = EngramHasher(tiny)
    assert hasher.primes.is_meta
    with pytest.raises(RuntimeError, match="meta device"):
        hasher(torch.zeros(1, 3, dtype=torch.long))
    hasher.to_empty(device="cpu")
    for name in ("primes", "offsets", "multipliers", "token_map"):
        assert torch.equal(getattr(hasher, name), getattr(ref, name)), name
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(4))
    assert all(torch.equal(a, b) for a, b in zip(hasher(ids), ref(ids)))
    assert hasher.state_dict() == {}  # constants never go into a checkpoint
    clone = copy.deepcopy(hasher)
    assert all(torch.equal(a, b) for a, b in zip(clone(ids), ref(ids)))


def test_hasher_rejects_bad_input(tiny):
    hasher = EngramHasher(tiny)
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 512\)"):
        hasher(torch.tensor([[1, 512]]))
    with pytest.raises(ValueError, match="token_types shape"):
        hasher(torch.tensor([[1, 2]]), torch.tensor([[-1]]))
    with pytest.raises(ValueError, match="int32/int64"):
        hasher(torch.tensor([1.0, 2.0]))


def _engram_inputs(cfg, seed=0, bsz=2, seqlen=12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.text.vocab_size, (bsz, seqlen), generator=gen)
    types = torch.full((bsz, seqlen), -1)
    types[0, 4:7] = torch.tensor([0, 1, 3])
    x = torch.randn(bsz, seqlen, cfg.text.hc_mult, cfg.text.hidden_size, generator=gen)
    return ids, types, x


def test_parameter_names_and_shapes(tiny):
    module = Engram(tiny, 0)
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    assert shapes == {"embed.weight": (462, 64), "wkv.weight": (320, 384), "q_weight": (4, 64), "k_weight": (4, 64)}
    # the same names/shapes as the tiny release census (`layers.{1,4}.engram.*`, scales aside)
    census = {}
    for line in (DATA / "tiny_tensors.tsv").read_text().splitlines():
        name, _dtype, shape = line.split("\t")
        if ".engram." in name and not name.endswith(".scale"):
            census[name] = tuple(int(s) for s in shape.split(","))
    for idx, layer in enumerate(tiny.text.engram_layer_ids):
        mine = {f"layers.{layer}.engram.{k}": tuple(v.shape) for k, v in Engram(tiny, idx).state_dict().items()}
        assert mine == {k: v for k, v in census.items() if k.startswith(f"layers.{layer}.")}


def test_forward_matches_formula_and_skips_image_tokens(tiny):
    hasher, module = EngramHasher(tiny), Engram(tiny, 1)
    ids, types, x = _engram_inputs(tiny)
    rows = hasher(ids, types)[1]
    mask = types < 0
    out = module(x, rows, mask)
    # formula, written independently of the module's code path
    e = module.embed.weight[rows].flatten(-2)  # [B,S,384]
    kv = e @ module.wkv.weight.t()
    d = tiny.text.hidden_size
    keys, value = kv[..., :4 * d].reshape(*kv.shape[:2], 4, d), kv[..., 4 * d:]
    w = module.q_weight * module.k_weight
    num = (x * w * keys).sum(-1)
    den = x.pow(2).mean(-1).add(1e-20).sqrt() * keys.pow(2).mean(-1).add(1e-20).sqrt() * math.sqrt(d)
    dot = num / den
    gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp_min(1e-6).sqrt()) * mask[..., None]
    want = x + gate[..., None] * value[:, :, None, :]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    # image-span positions: bit-identical pass-through; text positions: a real delta on every stream
    assert torch.equal(out[~mask], x[~mask])
    assert bool(((out - x)[mask].abs().amax(-1) > 0).all())


def test_gate_uses_copysign_at_zero(tiny):
    assert torch.equal(engram_gate(torch.tensor([0.0, -0.0])),
                       torch.sigmoid(torch.tensor([1e-3, -1e-3])))
    assert float(engram_gate(torch.tensor(0.0))) != 0.5
    # end to end: x = 0 gives dot = +0, so every stream receives sigmoid(1e-3) · value
    module = Engram(tiny, 0)
    rows = EngramHasher(tiny)(torch.tensor([[3, 4, 5]]))[0]
    x = torch.zeros(1, 3, 4, tiny.text.hidden_size)
    out = module(x, rows)
    value = module.wkv(module.lookup_rows(rows).flatten(-2))[..., 4 * tiny.text.hidden_size:]
    ratio = out / value[:, :, None, :]  # the gate itself, per stream and lane
    torch.testing.assert_close(ratio, torch.full_like(ratio, float(torch.sigmoid(torch.tensor(1e-3)))),
                               rtol=1e-6, atol=0.0)
    # a tiny negative dot is floored at |dot| = 1e-6 and keeps its sign
    assert torch.allclose(engram_gate(torch.tensor(-1e-12)), torch.sigmoid(torch.tensor(-1e-3)))


def test_gradients_reach_wkv_gate_weights_and_only_looked_up_rows(tiny):
    hasher, module = EngramHasher(tiny), Engram(tiny, 0)
    ids, types, x = _engram_inputs(tiny, seed=5)
    rows = hasher(ids, types)[0]
    mask = types < 0
    module(x.requires_grad_(), rows, mask).square().sum().backward()
    assert module.wkv.weight.grad.abs().sum() > 0
    assert module.q_weight.grad.abs().sum() > 0 and module.k_weight.grad.abs().sum() > 0
    table_grad = module.embed.weight.grad.abs().sum(-1)
    used_text = torch.unique(rows[mask])
    assert bool((table_grad[used_text] > 0).all())
    untouched = torch.ones(module.num_rows, dtype=torch.bool)
    untouched[torch.unique(rows)] = False
    assert bool((table_grad[untouched] == 0).all())
    # rows used only by image-span positions get nothing: their gate is 0
    image_only = torch.tensor(sorted(set(rows[~mask].flatten().tolist()) - set(rows[mask].flatten().tolist())))
    if image_only.numel():
        assert bool((table_grad[image_only] == 0).all())


def test_bf16_params_and_activations(tiny):
    module = Engram(tiny, 0, dtype=torch.bfloat16)
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    ids, types, x = _engram_inputs(tiny)
    out = module(x.bfloat16(), EngramHasher(tiny)(ids, types)[0], types < 0)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape


def test_forward_rejects_bad_shapes_and_rows(tiny):
    module = Engram(tiny, 0)
    x = torch.zeros(1, 2, 4, 64)
    with pytest.raises(ValueError, match=r"row_ids must be \[1, 2, 6\]"):
        module(x, torch.zeros(1, 2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"row ids must lie in \[0, 462\)"):
        module(x, torch.full((1, 2, 6), 462))
    with pytest.raises(ValueError, match="token_mask must be bool"):
        module(x, torch.zeros(1, 2, 6, dtype=torch.long), torch.ones(1, 2))
    with pytest.raises(ValueError, match="engram_index 2"):
        Engram(tiny, 2)


def test_flash_engram_builds_on_meta_without_allocating():
    cfg = load_config("flash")
    census = {}
    with gzip.open(DATA / "release_tensors.tsv.gz", "rt") as fh:
        for line in fh:
            name, _dtype, shape = line.rstrip("\n").split("\t")
            if name.startswith("layers.1.engram.") and not name.endswith(".scale"):
                census[name[len("layers.1.engram."):]] = tuple(int(s) for s in shape.split(","))
    # fp32 would be 384M x 256 x 4 B = 393 GB: only a meta build can finish here.
    with torch.device("meta"):
        module = Engram(cfg, 0)
        hasher = EngramHasher(cfg)
    assert all(p.is_meta for p in module.parameters())
    assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == census
    assert hasher.primes.is_meta and not hasher.has_token_map
    explicit = Engram(cfg, 1, dtype=torch.bfloat16, device="meta")
    assert explicit.embed.weight.shape == (384016682, 256) and explicit.embed.weight.is_meta


def test_build_compressed_token_map_normalises_like_ref():
    import tokenizers
    from tokenizers import decoders, models

    # Byte-level spellings: Ġ = space, Ċ = newline, "Ã" / "Ä" are lone UTF-8 lead bytes, "cafÃ©" = café.
    vocab = ["The", "the", "ĠTHE", "Ġ", "ĠĠ", "Ċ", "x", "Ã", "Ä", "cafÃ©", "CAFE", "Ġx"]
    tok = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="x"))
    tok.decoder = decoders.ByteLevel()
    got = build_compressed_token_map(tok).tolist()
    # case/accents/surrounding spaces collapse; all-whitespace tokens share one id; partial UTF-8 bytes
    # are keyed by their raw token string, so they stay apart; ids in order of first appearance.
    assert got == [0, 0, 0, 1, 1, 1, 2, 3, 4, 5, 5, 2]


@pytest.mark.gpu
def test_cuda_hashing_and_forward_match_cpu(tiny):
    hasher = EngramHasher(tiny)
    module = Engram(tiny, 0)
    ids, types, x = _engram_inputs(tiny, seed=6)
    want_rows = hasher(ids, types)
    want = module(x, want_rows[0], types < 0)
    with torch.device("meta"):
        on_meta = EngramHasher(tiny)
    on_meta.to_empty(device="cuda")  # materialised straight onto the GPU: constants restored there
    got_rows = on_meta(ids.cuda(), types.cuda())
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got_rows, want_rows))
    got = module.cuda()(x.cuda(), got_rows[0], (types < 0).cuda())
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
