"""DSV41-MBRIDGE-006: the DeepSeek-V4.1 ViT and 3x3 aligner in the Megatron model (`DeepSeekV41VLModel`).

The checkpoint is the whole tiny config (vision tower of 2 blocks, aligner, image delimiters, Engram layers 1 and
4, release layer plan SSFRFRCRIRIR, YaRN factor 4) as a 2-shard release checkpoint. The oracles are the reference
`dsv4flash.model.Transformer` (logits with images in the prompt, and its `VisionTower` + `Aligner` alone) loaded
with the same decoded tensors, its three fake-quant points off as in DSV41-MBRIDGE-001's test, and the
checkpoint's stored bytes (export). Both forms: the runtime twin (the DSV41-MBRIDGE-001 twin executes the shipped
`_upstream/` files, which carry this patch) and the pinned megatron-bridge with the series applied.

Image tokens route with `ffn.gate.bias_vl` (DSV41-MBRIDGE-005, on megatron-core's modality mask of
DSV41-MCORE-012): the checkpoint's `bias_vl` is random and distinct from `bias`, large enough to move image tokens
to other experts, so the parity checks the image routing too.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.patches.test_mbridge_deepseek_v41 import (SOURCE, _canonical_scales, _decoded, _stored, _tiny,
                                                     added_files, v41)  # noqa: F401  (v41 is a fixture)

PATCH_ID = "DSV41-MBRIDGE-006"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]
assert importlib.util.find_spec("megatron.bridge") is not None, "megatron-bridge is not installed"
GRIDS = ((4, 5), (3, 7))  # patch grids -> token grids (2, 2) and (1, 3)


def _with_distinct_image_bias(stream):
    """Every `ffn.gate.bias_vl` redrawn (0.5 * N(0, 1)): large enough to move image tokens to other experts."""
    gen = torch.Generator().manual_seed(9)
    for name, tensor in stream:
        if name.endswith(".ffn.gate.bias_vl"):
            tensor = (0.5 * torch.randn(tensor.shape, generator=gen)).to(tensor.dtype)
        yield name, tensor


@pytest.fixture(scope="module")
def vl_release(tmp_path_factory) -> Path:
    """The whole tiny config (vision tower kept) as a 2-shard release checkpoint."""
    from dsv4flash_bridge.synthetic import write_release_checkpoint

    from dsv4flash.integrations.mbridge import save_release

    root = tmp_path_factory.mktemp("v41_vision")
    data = _tiny()
    assert data["vision_config"]["num_hidden_layers"] == 2
    (root / "cfg").mkdir()
    (root / "cfg" / "config.json").write_text(json.dumps(data, indent=1))
    synthetic = write_release_checkpoint(root / "synthetic", root / "cfg" / "config.json", shards=2, seed=7)
    return save_release(_with_distinct_image_bias(_canonical_scales(synthetic)), synthetic, root / "release")


def _bridge(release: Path):
    """`AutoBridge` dispatched to the patch's `DeepSeekV41Bridge` for both model classes it serves."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge, get_model_bridge
    from megatron.bridge.models.deepseek_v41 import DeepSeekV41Bridge, DeepSeekV41ModelProvider, DeepSeekV41VLModel
    from megatron.core.models.gpt.gpt_model import GPTModel

    from dsv4flash.integrations.mbridge import ReleasePretrained

    if not isinstance(get_model_bridge(SOURCE), DeepSeekV41Bridge):  # the project's DSV41Bridge registered last
        for target in (GPTModel, DeepSeekV41VLModel):
            MegatronModelBridge.register_bridge(source=SOURCE, target=target, provider=DeepSeekV41ModelProvider,
                                                model_type="deepseek_v41")(DeepSeekV41Bridge)
    auto = AutoBridge(ReleasePretrained(release))
    assert isinstance(auto._model_bridge, DeepSeekV41Bridge)
    return auto


def _vl_model(auto):
    """The provider's model in fp32 with the checkpoint imported through the bridge."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    provider = auto.to_megatron_provider(load_weights=False)
    provider.params_dtype, provider.bf16 = torch.float32, False
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model = provider.provide()
    auto.load_hf_weights([model])
    return model.eval()


def _reference(release: Path, monkeypatch):
    from dsv4flash.model import attention, indexer
    from dsv4flash.model.transformer import Transformer

    reference = Transformer(str(release / "config.json"), seed=None)
    reference.load_state_dict(_decoded(release), strict=True)
    for module, name in ((attention, "fake_quant_window_kv"), (attention, "fake_quant_compressed_kv"),
                         (indexer, "fake_quant_index")):
        monkeypatch.setattr(module, name, lambda x: x)  # megatron-core's CSA2 has no fake-quant points
    return reference.eval()


def _images(seed: int):
    from dsv4flash.model.image import ImageInput

    gen = torch.Generator().manual_seed(seed)
    patch = 3 * _tiny()["vision_config"]["patch_size"] ** 2
    return [ImageInput(torch.rand(h * w, patch, generator=gen) * 2 - 1, (h, w)) for h, w in GRIDS]


def _prompt(n_images: int):
    """input_ids, token_types [2, 40]: row 0 holds the first image's span, row 1 the second's (if any)."""
    from dsv4flash.config import load_config
    from dsv4flash.model.image import image_token_types, llm_grid_hw

    cfg = load_config("tiny")
    ids = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(3))
    types = torch.full((2, 40), -1, dtype=torch.int64)
    for row, grid in enumerate(GRIDS[:n_images]):
        span = image_token_types(*llm_grid_hw(grid, cfg.vision.downsample_ratio))
        start = 6 + 5 * row
        types[row, start:start + span.numel()] = span
        ids[row, start:start + span.numel()] = cfg.image_token_id
    return ids, types


def _pixels(images):
    return torch.cat([i.patches for i in images]), torch.tensor([i.grid_hw for i in images])


@pytest.mark.slow
def test_without_the_patch_the_v41_bridge_refuses_the_vision_tower(tmp_path):
    """The pinned megatron-bridge with DSV41-MBRIDGE-001 but not this patch refuses the tiny config by name."""
    import os
    import subprocess
    import sys

    from dsv4flash.patchseries import copies, fetch
    from dsv4flash.patchseries.series import load_series
    from tests.patches.test_mbridge_deepseek_v41 import ROOT

    series_map = load_series(ROOT / "patches")
    series = series_map["megatron-bridge"]
    opts = fetch.FetchOptions(source=os.environ.get("DSV4FLASH_PATCH_SOURCE", "auto"))
    tree = copies.patched_copy(series, ("DSV41-MBRIDGE-001",), opts)
    others = copies.upstream_dependency_copies(series_map, series.by_id()["DSV41-MBRIDGE-001"], opts)
    (tmp_path / "config.json").write_text(json.dumps(_tiny()))
    script = (
        "import json, sys\n"
        "from dsv4flash.cpu_mode import mbridge_import\n"
        "mbridge_import.install()\n"
        "from megatron.bridge.models.deepseek_v41.deepseek_v41_bridge import provider_kwargs_from_hf\n"
        f"provider_kwargs_from_hf(json.load(open({str(tmp_path / 'config.json')!r})))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree.sys_path), *(str(o.sys_path) for o in others),
                                                         str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "ValueError: vision_config.num_hidden_layers is 2" in proc.stderr, proc.stderr[-2000:]


def test_twin_files_are_the_patched_tree():
    """The shipped `_upstream/` package is 001's new files as this patch leaves them, plus this patch's new files."""
    from dsv4flash.integrations.mbridge.patches import deepseek_v41_bridge as twin

    shipped = {str(p.relative_to(twin.UPSTREAM_SOURCES)): p.read_text()
               for p in (twin.UPSTREAM_SOURCES / twin.FOLDER).glob("*.py")}
    new = {rel: body for rel, body in added_files(PATCH_ID).items() if rel.startswith(twin.FOLDER)}
    assert set(new) == {f"{twin.FOLDER}/deepseek_v41_vision.py", f"{twin.FOLDER}/deepseek_v41_vl_model.py"}
    assert set(shipped) == set(new) | {rel for rel in added_files("DSV41-MBRIDGE-001") if rel.startswith(twin.FOLDER)}
    for rel, body in new.items():
        assert shipped[rel] == body, rel
    # The shipped provider and bridge are 001's files with this patch's edits; DSV41-MBRIDGE-005's edits of them
    # arrive through its twin's replacements, which this twin re-replaces (the both-forms tests compare them).
    tree = _patched_tree(PATCH_ID)
    for rel in new:
        assert (tree.root / rel).read_text() == shipped[rel], f"{rel}: the twin's copy differs from the patched tree"


def _patched_tree(*patch_ids):
    import os

    from dsv4flash.patchseries import copies, fetch
    from dsv4flash.patchseries.series import load_series
    from tests.patches.test_mbridge_deepseek_v41 import ROOT

    series = load_series(ROOT / "patches")["megatron-bridge"]
    return copies.patched_copy(series, patch_ids, fetch.FetchOptions(source=os.environ.get(
        "DSV4FLASH_PATCH_SOURCE", "auto")))


def test_vision_config_becomes_provider_fields(patch_form, v41):
    from megatron.bridge.models.deepseek_v41.deepseek_v41_bridge import provider_kwargs_from_hf

    tiny = _tiny()
    kwargs = provider_kwargs_from_hf(tiny)
    vision = {k: v for k, v in kwargs.items() if k.startswith("vision_")}
    assert vision == dict(vision_num_layers=2, vision_hidden_size=32, vision_num_attention_heads=2,
                          vision_ffn_hidden_size=64, vision_patch_size=14, vision_downsample_ratio=3,
                          vision_rope_theta=10000.0, vision_layernorm_epsilon=1e-6)
    assert kwargs["scatter_embedding_sequence_parallel"] is False
    tiny["vision_config"].pop("intermediate_size")
    with pytest.raises(ValueError, match=r"vision_config\.intermediate_size"):
        provider_kwargs_from_hf(tiny)
    tiny["vision_config"]["num_hidden_layers"] = 0
    assert not any(k.startswith("vision_") for k in provider_kwargs_from_hf(tiny))
    patch_form.record("vision", sorted(vision.items()))


@pytest.mark.slow
def test_vl_model_gives_the_reference_logits_with_images(patch_form, v41, mcore_parallel, vl_release, monkeypatch):
    from megatron.bridge.models.deepseek_v41 import DeepSeekV41VLModel
    from megatron.core.models.gpt.gpt_model import GPTModel

    model = _vl_model(_bridge(vl_release))
    assert isinstance(model, DeepSeekV41VLModel) and isinstance(model.language_model, GPTModel)
    # LoRA target names are the project's runtime ones (vision_model.*, vision_projection.*).
    names = {n for n, _ in model.named_parameters()}
    assert {"vision_model.decoder.layers.1.self_attention.linear_qkv.weight",
            "vision_model.decoder.layers.0.mlp.linear_fc1.weight",
            "vision_projection.encoder.linear_fc2.bias", "image_newline"} <= names
    reference = _reference(vl_release, monkeypatch)
    images = _images(seed=11)
    positions = torch.arange(40).expand(2, -1)
    results = {}
    for n_images in (1, 2):
        ids, types = _prompt(n_images)
        pixels, grids = _pixels(images[:n_images])
        with torch.no_grad():
            got = model(ids, positions, None, pixel_values=pixels, image_grid_hw=grids, token_types=types).float()
            want = reference(ids, types, images[:n_images])  # [b, s, vocab]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        results[n_images] = got
    # The parity is far tighter than bias_vl's effect: routing image tokens with the text bias moves the logits.
    routers = [layer.mlp.router for layer in model.language_model.decoder.layers]
    saved = [r.modality_expert_bias.expert_bias.clone() for r in routers]
    with torch.no_grad():
        for router in routers:
            router.modality_expert_bias.expert_bias.copy_(router.expert_bias)
        text_bias = model(ids, positions, None, pixel_values=pixels, image_grid_hw=grids, token_types=types).float()
        for router, bias in zip(routers, saved):
            router.modality_expert_bias.expert_bias.copy_(bias)
    assert (results[2] - want).abs().max() < 0.01 * (results[2] - text_bias).abs().max(), "parity looser than bias_vl"
    # Other pixels change the logits from the first image span on, and still match the reference.
    ids, types = _prompt(2)
    other = _images(seed=12)
    with torch.no_grad():
        moved = model(ids, positions, None, pixel_values=_pixels(other)[0], image_grid_hw=_pixels(other)[1],
                      token_types=types).float()
        torch.testing.assert_close(moved, reference(ids, types, other), rtol=1e-5, atol=1e-5)
    first = int((types[0] >= 0).nonzero()[0])
    assert torch.equal(moved[0, :first], results[2][0, :first])  # causal: text before the span is unchanged
    assert (moved[0, first:] - results[2][0, first:]).abs().max() > 10 * 1e-5  # 10x the parity tolerance
    patch_form.record("logits_one_image", results[1], rtol=1e-5, atol=1e-5)
    patch_form.record("logits_two_images", results[2], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_vit_and_aligner_alone_match_the_reference(patch_form, v41, mcore_parallel, vl_release, monkeypatch):
    model = _vl_model(_bridge(vl_release))
    reference = _reference(vl_release, monkeypatch)
    for image in _images(seed=5):
        with torch.no_grad():
            features = model.vision_model(image.patches, image.grid_hw)  # [n_h*n_w, C]
            rows = model.vision_projection(features, image.grid_hw)  # [H'*W', D]
            want_features = reference.vision(image.patches, image.grid_hw)
            want_rows = reference.aligner(want_features, image.grid_hw)
        torch.testing.assert_close(features, want_features, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=1e-5)
        patch_form.record(f"rows_{image.grid_hw[0]}x{image.grid_hw[1]}", rows, rtol=1e-5, atol=1e-5)
    # Norm weights stay fp32 through a bf16 cast of the whole model (Float16Module does that).
    model.bfloat16()
    assert model.vision_model.decoder.final_layernorm.weight.dtype == torch.float32
    assert model.vision_model.decoder.layers[0].self_attention.linear_qkv.weight.dtype == torch.bfloat16


@pytest.mark.slow
def test_lora_targets_the_vit_by_the_runtime_names(patch_form, v41, mcore_parallel, vl_release, monkeypatch):
    """The project's `DSV41LoRA` (megatron-bridge's LoRA) on the VL model: `adapt_vision` keeps adapters off or on
    `vision_model.*` / `vision_projection.*` as on the project's runtime model; fresh adapters change nothing."""
    from dsv4flash.integrations import mbridge

    ids, types = _prompt(2)
    pixels, grids = _pixels(_images(seed=11))
    positions = torch.arange(40).expand(2, -1)
    wrapped = {}
    for adapt_vision in (False, True):
        model = _vl_model(_bridge(vl_release))
        with torch.no_grad():
            before = model(ids, positions, None, pixel_values=pixels, image_grid_hw=grids, token_types=types)
        lora = mbridge.DSV41LoRA(target_modules=["linear_qkv", "linear_proj", "linear_fc1"], dim=4, alpha=8,
                                 adapt_vision=adapt_vision)
        model = lora(model, training=True)
        names = sorted(n for n, m in model.named_modules() if hasattr(m, "adapter") and hasattr(m, "to_wrap"))
        vision = [n for n in names if n.startswith(("vision_model.", "vision_projection."))]
        assert any(n.startswith("language_model.decoder.layers.") for n in names), names
        if adapt_vision:
            assert {"vision_model.decoder.layers.0.self_attention.linear_qkv",
                    "vision_model.decoder.layers.1.self_attention.linear_proj",
                    "vision_model.decoder.layers.0.mlp.linear_fc1",
                    "vision_projection.encoder.linear_fc1"} <= set(vision), vision
        else:
            assert vision == []
        with torch.no_grad():  # LoRA B starts at zero
            after = model(ids, positions, None, pixel_values=pixels, image_grid_hw=grids, token_types=types)
        torch.testing.assert_close(after, before, rtol=0, atol=0)
        wrapped[adapt_vision] = vision
    patch_form.record("vision_adapters", wrapped[True])


@pytest.mark.slow
def test_export_is_bit_exact_to_every_stored_tensor(patch_form, v41, mcore_parallel, vl_release):
    from megatron.bridge.models.hf_pretrained.row_chunks import TensorRowChunk

    auto = _bridge(vl_release)
    model = _vl_model(auto)
    exported = {}
    for name, tensor in auto.export_hf_weights([model], show_progress=False):
        if isinstance(tensor, TensorRowChunk):  # Engram tables stream as row chunks
            exported[name] = tensor.rows if tensor.start == 0 else torch.cat([exported[name], tensor.rows])
        else:
            exported[name] = tensor
    stored = _stored(vl_release)
    expected = set(stored)
    assert set(exported) == expected
    assert any(n.endswith(".ffn.gate.bias_vl") for n in expected)
    vision = sorted(n for n in expected if n.startswith(("vision.", "aligner.", "image_")))
    assert len(vision) == 2 + 2 * 8 + 1 + 4 + 3, vision  # patch_embed, 2 blocks of 8, norm, aligner, delimiters
    for name in expected:
        got, want = exported[name], stored[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    patch_form.record("vision_names", vision)


def _tp_rank(rank: int, world_size: int, form: str, out_dir: str) -> None:
    """One of two TP ranks: the ViT and aligner built at TP 2, loaded and exported through the bridge's mappings."""
    import types

    from dsv4flash.patching import twins
    from dsv4flash.cpu_mode.mbridge_import import install
    from tests.mcore_cpu import parallel

    install()
    registry = twins.discover()
    if form == "runtime":
        for patch_id in ("DSV41-MCORE-011", PATCH_ID):
            assert registry.get(patch_id).apply().active, f"{patch_id}: the runtime twin did not apply in the rank"
    else:
        assert registry.get(PATCH_ID).upstream_has_it(), "the rank does not run the patched copy"
    from megatron.bridge.models.conversion.utils import get_module_and_param_from_name
    from megatron.bridge.models.deepseek_v41.deepseek_v41_bridge import DeepSeekV41Bridge, provider_kwargs_from_hf
    from megatron.bridge.models.deepseek_v41.deepseek_v41_vision import (
        DeepSeekV41VisionModel, DeepSeekV41VisionProjection, get_deepseek_v41_vision_config,
        get_deepseek_v41_vision_layer_spec, get_deepseek_v41_vision_projection_config,
        get_deepseek_v41_vision_projection_spec)

    from dsv4flash.model.transformer import Transformer

    tiny = _tiny()
    reference = Transformer("tiny", seed=3).eval()
    hf = reference.state_dict()
    with parallel.model_parallel(tp=world_size, rank=rank, world_size=world_size, seed=1):
        kwargs = provider_kwargs_from_hf(tiny)
        provider = types.SimpleNamespace(
            **{k: v for k, v in kwargs.items() if k.startswith("vision_")}, init_method_std=0.02,
            tensor_model_parallel_size=world_size, params_dtype=torch.float32, bf16=False, fp16=False,
            use_cpu_initialization=True, perform_initialization=True)
        vision_config = get_deepseek_v41_vision_config(provider)
        model = torch.nn.Module()
        model.vision_model = DeepSeekV41VisionModel(vision_config, get_deepseek_v41_vision_layer_spec(),
                                                    provider.vision_patch_size, provider.vision_rope_theta)
        model.vision_projection = DeepSeekV41VisionProjection(
            get_deepseek_v41_vision_projection_config(vision_config, tiny["text_config"]["hidden_size"]),
            get_deepseek_v41_vision_projection_spec(), provider.vision_hidden_size, provider.vision_downsample_ratio)
        bridge = DeepSeekV41Bridge()
        bridge.hf_config = tiny
        mappings = bridge.mapping_registry()
        exported, shards = {}, {}
        for name, param in model.named_parameters():
            mapping = mappings.megatron_to_hf_lookup(name)
            module, _ = get_module_and_param_from_name(model, name)
            with torch.no_grad():
                param.copy_(mapping.hf_to_megatron(hf[mapping.hf_param], module))
            shards[name] = list(param.shape)
            exported.update(mapping.megatron_to_hf(param.detach(), module))
        rows = []
        with torch.no_grad():
            for image in _images(seed=5):
                got = model.vision_projection(model.vision_model(image.patches, image.grid_hw), image.grid_hw)
                want = reference.aligner(reference.vision(image.patches, image.grid_hw), image.grid_hw)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                rows.append(got.tolist())
    assert exported.keys() == {n for n in hf if n.startswith(("vision.", "aligner."))}
    for name, tensor in exported.items():  # gathered and re-fused exactly
        assert torch.equal(tensor, hf[name]), name
    result = {"rows": rows, "shards": shards}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
@pytest.mark.whole_machine
def test_tensor_parallel_vit_splits_heads_and_mlp(patch_form, v41, mcore_parallel, tmp_path):
    """TP 2: each rank holds half the ViT heads, half its MLP and half the aligner width; the gathered output
    equals the reference, and the export of the shards re-fuses `wqkv` / `w1` bit for bit."""
    mcore_parallel.spawn_gloo(_tp_rank, 2, patch_form.name, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["rows"] == ranks[1]["rows"]
    shards = ranks[0]["shards"]
    assert shards["vision_model.decoder.layers.0.self_attention.linear_qkv.weight"] == [48, 32]  # 1 of 2 heads
    assert shards["vision_model.decoder.layers.0.mlp.linear_fc1.weight"] == [64, 32]  # [gate_i ; up_i]
    assert shards["vision_model.decoder.layers.0.mlp.linear_fc2.weight"] == [32, 32]
    assert shards["vision_projection.encoder.linear_fc1.weight"][0] == _tiny()["text_config"]["hidden_size"] // 2
    patch_form.record("rows", [torch.tensor(r) for r in ranks[0]["rows"]], rtol=1e-5, atol=1e-5)


def test_bad_image_inputs_are_refused_by_name(patch_form, v41, mcore_parallel, vl_release):
    model = _vl_model(_bridge(vl_release))
    ids, types = _prompt(2)
    positions = torch.arange(40).expand(2, -1)
    pixels, grids = _pixels(_images(seed=1))
    errors = []
    for kwargs, match in ((dict(pixel_values=pixels, image_grid_hw=grids), "token_types"),
                          (dict(pixel_values=pixels, token_types=types), "image_grid_hw"),
                          (dict(pixel_values=pixels[:-1], image_grid_hw=grids, token_types=types), "pixel_values"),
                          (dict(pixel_values=pixels[:20], image_grid_hw=grids[:1], token_types=types), "2 image spans"),
                          (dict(token_types=types), "no pixel_values")):
        with pytest.raises(ValueError, match=match) as info:
            model(ids, positions, None, **kwargs)
        errors.append(str(info.value))
    patch_form.record("errors", errors)


def test_vit_lives_on_the_first_pipeline_stage_only(patch_form, v41, mcore_parallel, vl_release):
    """A stage without the embedding (pre_process=False) builds no ViT, aligner or delimiters; the first does."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    provider = _bridge(vl_release).to_megatron_provider(load_weights=False)
    provider.params_dtype, provider.bf16 = torch.float32, False
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    counts = {}
    for pre_process in (True, False):
        model = provider.provide(pre_process=pre_process, post_process=True)
        vision = [n for n, _ in model.named_parameters() if not n.startswith("language_model.")]
        assert (model.vision_model is None) == (not pre_process) and bool(vision) == pre_process, vision
        counts[pre_process] = len(vision)
    assert counts[True] == 2 + 2 * 8 + 1 + 4 + 3
    patch_form.record("vision_params_per_stage", sorted(counts.items()))


@pytest.mark.slow
def test_gradients_reach_the_vit_aligner_and_delimiters_unless_frozen(patch_form, v41, mcore_parallel, vl_release):
    """Training through the VL model: the loss reaches the ViT, the aligner and the delimiter vectors; the
    provider's freeze switches (as megatron-bridge's VL providers have them) stop exactly their parts."""
    auto = _bridge(vl_release)
    ids, types = _prompt(2)
    pixels, grids = _pixels(_images(seed=11))
    positions = torch.arange(40).expand(2, -1)
    probes = ("vision_model.patch_embed.proj.weight", "vision_model.decoder.layers.0.self_attention.linear_qkv.weight",
              "vision_projection.encoder.linear_fc1.weight", "image_start", "image_newline", "image_end",
              "language_model.output_layer.weight")
    seen = {}
    for freeze in ({}, {"freeze_vision_model": True}, {"freeze_vision_projection": True}):
        from megatron.core.process_groups_config import ProcessGroupCollection

        provider = auto.to_megatron_provider(load_weights=False)
        provider.params_dtype, provider.bf16 = torch.float32, False
        for key, value in freeze.items():
            setattr(provider, key, value)
        provider.finalize()
        provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        model = provider.provide()
        auto.load_hf_weights([model])
        params = dict(model.named_parameters())
        logits = model(ids, positions, None, pixel_values=pixels, image_grid_hw=grids, token_types=types)
        logits.square().sum().backward()
        got = {n: params[n].grad is not None and bool(params[n].grad.abs().sum() > 0) for n in probes}
        frozen_vit = bool(freeze.get("freeze_vision_model"))
        frozen_projection = bool(freeze.get("freeze_vision_projection"))
        assert got == {probes[0]: not frozen_vit, probes[1]: not frozen_vit, probes[2]: not frozen_projection,
                       probes[3]: not frozen_projection, probes[4]: not frozen_projection,
                       probes[5]: not frozen_projection, probes[6]: True}, (freeze, got)
        seen[",".join(freeze) or "none"] = sorted(n for n, ok in got.items() if ok)
    patch_form.record("trained", sorted(seen.items()))


def test_vision_tensors_with_a_text_only_config_are_refused_by_name(patch_form, v41, vl_release, tmp_path):
    """A checkpoint holding vision tensors whose config has no vision tower: the first such tensor is named."""
    import shutil

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(vl_release, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["vision_config"]["num_hidden_layers"] = 0
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^(vision|aligner|image_)\S*: a vision-tower / aligner tensor, but "
                                         r"vision_config\.num_hidden_layers is 0") as info:
        _bridge(checkpoint).to_megatron_provider(load_weights=False)
    patch_form.record("error", str(info.value))
