"""`DSV41Bridge` on the real megatron-bridge 0.6.x (CPU): registration, the mapping registry against the
Megatron model, import through `AutoBridge` (32×32 FP8, MXFP4, Engram decode) and bit-exact export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4flash.config import load_config
from dsv4flash.release.quant_plan import QuantRole, quant_role, scale_name
from dsv4flash_bridge import codecs, mapping
from dsv4flash_bridge.sharded import CheckpointReader
from dsv4flash_bridge.synthetic import write_release_checkpoint

pytestmark = [pytest.mark.upstream]
QUANTIZED = (QuantRole.DENSE_FP8, QuantRole.EXPERT_MXFP4, QuantRole.ENGRAM_FP8)


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """The tiny config as a 2-shard release checkpoint."""
    return write_release_checkpoint(tmp_path_factory.mktemp("rel") / "release", "tiny", shards=2, seed=5)


def decoded(directory: Path) -> dict[str, torch.Tensor]:
    """Every weight decoded in memory with the codecs (fp32), keyed by release name."""
    with CheckpointReader(directory) as ckpt:
        names = set(ckpt.names())
        return {n: (codecs.decode(quant_role(n), ckpt.read(n), ckpt.read(scale_name(n)), name=n)
                    if quant_role(n) in QUANTIZED else ckpt.read(n).float())
                for n in ckpt.names() if not mapping.is_carried_scale(n, names)}


def megatron_model(mbridge, release: Path):
    """A tiny `DSV41MegatronModel` for the checkpoint's config (random init)."""
    return mbridge.provider_for(release).provide()


def files(directory: Path) -> dict[str, bytes]:
    """Top-level file name -> bytes."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_importing_the_integration_imports_no_megatron_bridge():
    code = ("import sys, dsv4flash.integrations.mbridge as m\n"
            "print(sorted(n for n in sys.modules if n.startswith(('megatron', 'transformer_engine'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_registration_is_idempotent_and_survives_being_overridden(mbridge, monkeypatch):
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge, get_model_bridge

    from dsv4flash.integrations.mbridge.bridge import DSV41Bridge

    calls = []
    real = MegatronModelBridge.register_bridge
    monkeypatch.setattr(MegatronModelBridge, "register_bridge",
                        lambda **kw: calls.append(kw) or real(**kw))
    assert mbridge.register() is DSV41Bridge and mbridge.register() is DSV41Bridge
    assert calls == [] and isinstance(get_model_bridge(mbridge.SOURCE), DSV41Bridge)

    class Intruder(MegatronModelBridge):
        pass

    from dsv4flash.integrations.mcore.csa2 import DSV41MegatronModel

    real(source=mbridge.SOURCE, target=DSV41MegatronModel)(Intruder)  # last registration wins in Megatron-Bridge
    assert not mbridge.is_registered()
    assert mbridge.register() is DSV41Bridge and mbridge.is_registered() and len(calls) == 1
    assert DSV41Bridge.SOURCE_NAME == "DeepseekV41ForCausalLM" and DSV41Bridge.MODEL_TYPE == "deepseek_v41"


def test_registry_maps_every_megatron_tensor_to_the_tables_release_names(mbridge, mcore, release):
    from dsv4flash.integrations.mbridge.bridge import DSV41Bridge

    registry = DSV41Bridge().mapping_registry()
    model = megatron_model(mbridge, release)
    names = [n for n in model.state_dict() if not n.endswith("._extra_state")]
    with CheckpointReader(release) as ckpt:
        release_names = set(ckpt.names())
    for name in names:
        found = registry.megatron_to_hf_lookup(name)
        assert found is not None, name
        hf = [found.hf_param] if isinstance(found.hf_param, str) else list(found.hf_param.values())
        assert hf == list(mapping.megatron_lookup(name).release) and set(hf) <= release_names, name
    grouped = registry.megatron_to_hf_lookup("decoder.layers.3.mlp.experts.linear_fc1.weight5")  # TE grouped GEMM
    assert grouped.hf_param == {"gate": "layers.3.ffn.experts.5.w1.weight", "up": "layers.3.ffn.experts.5.w3.weight"}


def test_autobridge_loads_the_release_with_32_block_decode(mbridge, mcore, release):
    from megatron.bridge import AutoBridge

    from dsv4flash.integrations.mcore.csa2 import load_reference_state
    from dsv4flash.model.transformer import Transformer

    auto = AutoBridge(mbridge.ReleasePretrained(release))
    model = megatron_model(mbridge, release)
    auto.load_hf_weights([model])
    state = decoded(release)
    oracle = megatron_model(mbridge, release)
    load_reference_state(oracle, state)  # the plugin's own loader, from the in-memory decode
    got, want = model.state_dict(), oracle.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        if not name.endswith("._extra_state"):
            assert torch.equal(got[name], want[name]), name
    reference = Transformer("tiny", seed=None)
    reference.load_state_dict(state, strict=True)
    ids = torch.randint(0, 500, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), reference.eval()(ids), rtol=0, atol=1e-5)


def test_megatron_bridge_default_block_size_is_refused_after_register(mbridge):
    """Stock 0.6.2 decodes this silently wrong with its 128 default (tests/patches/test_mbridge_fp8_block_size.py);
    with DSV41-MBRIDGE-002 applied by `register()` the default refuses the 32-block grid and block_size=32 agrees
    with the bridge's own decode."""
    from megatron.bridge.models.conversion import quantization_utils as qu

    from dsv4flash.integrations.mbridge.bridge import DSV41Bridge

    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    w[32:] *= 16  # the two 32-row block rows get different scales
    q, s = codecs.encode_dense_fp8(w)
    name = "layers.0.attn.wo_b.weight"
    state = {name: q, scale_name(name): s}
    ours = DSV41Bridge().maybe_modify_loaded_hf_weight(name, state)
    assert torch.equal(ours, codecs.decode(QuantRole.DENSE_FP8, q, s))
    assert torch.equal(qu.maybe_dequantize_hf_quantized_weight(name, state, dtype=torch.float32, block_size=32), ours)
    with pytest.raises(RuntimeError, match="FP8 scale grid mismatch"):
        qu.maybe_dequantize_hf_quantized_weight(name, state, dtype=torch.float32)  # 128-row blocks


def test_export_restores_the_release_bit_exactly(mbridge, mcore, release, tmp_path):
    from megatron.bridge import AutoBridge

    auto = AutoBridge(mbridge.ReleasePretrained(release))
    model = megatron_model(mbridge, release)
    auto.load_hf_weights([model])
    mbridge.save_release(auto.export_hf_weights([model], show_progress=False), release, tmp_path / "out")
    assert files(tmp_path / "out") == files(release)


def test_export_after_training_changes_only_the_touched_blocks(mbridge, mcore, release, tmp_path):
    from megatron.bridge import AutoBridge

    auto = AutoBridge(mbridge.ReleasePretrained(release))
    model = megatron_model(mbridge, release)
    auto.load_hf_weights([model])
    with torch.no_grad():
        model.decoder.layers[2].self_attention.linear_q_down.weight[5, 3] += 0.5
    mbridge.save_release(auto.export_hf_weights([model], show_progress=False), release, tmp_path / "out")
    with CheckpointReader(release) as before, CheckpointReader(tmp_path / "out") as after:
        changed = [n for n in before.names() if not torch.equal(before.read(n).view(torch.uint8),
                                                                 after.read(n).view(torch.uint8))]
        assert set(changed) <= {"layers.2.attn.wq_a.weight", "layers.2.attn.wq_a.scale"} and changed
        w = codecs.decode(QuantRole.DENSE_FP8, after.read("layers.2.attn.wq_a.weight"),
                          after.read("layers.2.attn.wq_a.scale"))
        old = codecs.decode(QuantRole.DENSE_FP8, before.read("layers.2.attn.wq_a.weight"),
                            before.read("layers.2.attn.wq_a.scale"))
    diff = (w != old).nonzero().tolist()
    assert all(r // 32 == 0 and c // 32 == 0 for r, c in diff)  # only the 32×32 block holding [5, 3] moved
    assert abs(float(w[5, 3] - old[5, 3]) - 0.5) < 0.5 * 2 ** -3


@pytest.mark.parametrize("table_dtype", [torch.float8_e4m3fn, torch.float32])
def test_host_pinned_engram_tables_load_and_export(mbridge, mcore, release, tmp_path, table_dtype):
    """Host tables are not parameters, so Megatron-Bridge alone would skip them: the bridge streams them in
    (FP8 tables byte for byte) and back out."""
    from megatron.bridge import AutoBridge
    from megatron.core.transformer.spec_utils import ModuleSpec

    from dsv4flash.integrations.mcore.engram import PinnedEngram

    auto = AutoBridge(mbridge.ReleasePretrained(release))
    provider = mbridge.provider_for(release)
    provider.engram = ModuleSpec(module=PinnedEngram, params={"table_dtype": table_dtype})
    model = provider.provide()
    table = model.decoder.layers[1].engram.table
    with torch.no_grad():
        table.weight.view(torch.uint8).zero_()
    auto.load_hf_weights([model])
    name = "layers.1.engram.embed.weight"
    with CheckpointReader(release) as ckpt:
        want = codecs.decode(QuantRole.ENGRAM_FP8, ckpt.read(name), ckpt.read(scale_name(name)))
        if table_dtype == torch.float8_e4m3fn:
            assert torch.equal(table.weight.view(torch.uint8), ckpt.read(name).view(torch.uint8))
            assert torch.equal(table.scale.view(torch.uint8), ckpt.read(scale_name(name)).view(torch.uint8))
        else:
            assert torch.equal(table.weight, want)
    exported = dict(auto.export_hf_weights([model], show_progress=False))
    assert name in exported and scale_name(name) in exported  # the tables come from the model, not the source
    mbridge.save_release(exported.items(), release, tmp_path / "out")
    assert files(tmp_path / "out") == files(release)


def test_vit_aligner_and_delimiters_round_trip_through_the_megatron_model(mbridge, mcore, release, tmp_path):
    """The ViT, aligner and image delimiters are Megatron parameters: imported, exported from the model (nothing
    copied through: `copy_missing=False`), bit-exact, and a trained ViT weight lands in its release row."""
    from megatron.bridge import AutoBridge

    auto = AutoBridge(mbridge.ReleasePretrained(release))
    model = megatron_model(mbridge, release)
    auto.load_hf_weights([model])
    mbridge.save_release(auto.export_hf_weights([model], show_progress=False), release, tmp_path / "out",
                         copy_missing=False)
    assert files(tmp_path / "out") == files(release)
    with CheckpointReader(release) as ckpt:
        vision = [n for n in ckpt.names() if n.startswith(("vision.", "aligner.", "image_"))]
    assert len(vision) == 2 + 8 * 2 + 1 + 4 + 3  # patch embed, 2 blocks, norm, aligner, delimiters
    width = load_config("tiny").vision.hidden_size // 2  # rows per head
    with torch.no_grad():  # Megatron row `width + 3` = head 0's k row 3 = release row 2·width + 3
        model.vision_model.decoder.layers[1].self_attention.linear_qkv.weight[width + 3, 5] += 0.25
    mbridge.save_release(auto.export_hf_weights([model], show_progress=False), release, tmp_path / "trained",
                         copy_missing=False)
    name = "vision.blocks.1.attn.wqkv.weight"
    with CheckpointReader(release) as before, CheckpointReader(tmp_path / "trained") as after:
        changed = [n for n in before.names() if not torch.equal(before.read(n).view(torch.uint8),
                                                                 after.read(n).view(torch.uint8))]
        assert changed == [name]
        diff = (after.read(name) != before.read(name)).nonzero().tolist()
    assert diff == [[2 * width + 3, 5]]
