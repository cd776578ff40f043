"""DSV41-MBRIDGE-001: the DeepSeek-V4.1 bridge and provider as megatron-bridge model code (`models/deepseek_v41/`).

The stock test shows 0.6.2 has no V4.1 bridge of its own. The `patch_form` tests run with the runtime twin on the
installed megatron-bridge and on a copy of the pinned release with the format-patch applied; megatron-core's CSA2 /
mHC modules (layer kind C, YaRN) come from the DSV41-MCORE-011 twin in the runtime form and, in the series form,
from the pinned megatron-core with the megatron-lm series applied up to DSV41-MCORE-011 (the patch's
`Depends-On: megatron-lm/DSV41-MCORE-011`). The input is a tiny release-format checkpoint (32x32 FP8, MXFP4
experts, BF16/FP32 tensors) written here; the oracles are the reference `dsv4flash.model.Transformer` loaded
with the same decoded tensors (logits) and the checkpoint's own stored bytes (export).

The checkpoint is the tiny config's text decoder with its release layer plan (SSFRFRCRIRIR: layer 6 compresses
keys and builds the candidate pool layers 8 and 10 search) and YaRN (factor 4) on compressed layers, without the
vision tower (mapped by DSV41-MBRIDGE-006: tests/patches/test_mbridge_deepseek_v41_vision.py); once without and once with its Engram layers (1 and 4: per-row
FP8 tables imported in row chunks through DSV41-MBRIDGE-003's `load_rows`). The reference runs with its three fake-quant
points off (window KV FP8, compressed KV FP4, index Q/K FP4): megatron-core's CSA2 has none.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from dsv4flash.patchseries.testing import FORM_ENV

PATCH_ID = "DSV41-MBRIDGE-001"
ROOT = Path(__file__).resolve().parents[2]
SOURCE = "DeepseekV41ForCausalLM"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]
# a test dependency (ci/install.sh test); not imported here: it needs the CPU shim first
assert importlib.util.find_spec("megatron.bridge") is not None, "megatron-bridge is not installed"


def text_only_config(dst: Path, engram: bool = False) -> Path:
    """The tiny release config without vision tower (and without Engram layers unless `engram`) -> config.json."""
    data = _tiny()
    if not engram:
        data["text_config"].update(engram_layer_ids=[], engram_num_embeddings=[])
    data["vision_config"]["num_hidden_layers"] = 0
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(data, indent=1))
    return dst / "config.json"


def added_files(patch_id: str) -> dict[str, str]:
    """The files a megatron-bridge format-patch creates: repository path -> content."""
    from dsv4flash.patchseries.series import load_series

    patch = load_series(ROOT / "patches")["megatron-bridge"].by_id()[patch_id]
    added = {}
    for rel in patch.files:
        if f"--- /dev/null\n+++ b/{rel}" in patch.diff:
            hunk = patch.diff.split(f"+++ b/{rel}\n", 1)[1].split("\ndiff --git", 1)[0]
            added[rel] = "".join(line[1:] + "\n" for line in hunk.splitlines()[1:] if line.startswith("+"))
    return added


def _tiny() -> dict:
    from dsv4flash.config import load_config

    return load_config("tiny").to_hf()


@pytest.fixture(scope="module")
def v41():
    """megatron-bridge (CPU import shim) with megatron-core's CSA2 / mHC modules: the DSV41-MCORE-011 twin on a stock
    megatron-core; in the series form the patched megatron-core the harness puts on the path, where the twin's probe
    finds them. In the [runtime] form the harness applies the bridge twin."""
    from dsv4flash.patching import twins
    from dsv4flash.cpu_mode.mbridge_import import install

    install()
    csa2 = twins.discover().get("DSV41-MCORE-011")
    applied_here = not csa2.applied
    outcome = csa2.apply(mode="auto")
    assert outcome.active, outcome
    if os.environ.get(FORM_ENV) == "series":  # the patched megatron-core tree is on the path, not the twin
        assert outcome is twins.Outcome.UPSTREAM_HAS_IT, outcome
    yield
    if applied_here:
        for twin in reversed(twins.REGISTRY.all()):
            if twin.applied and twin.meta.distribution == "megatron-core":
                twin.revert()


def _release_checkpoint(root: Path, engram: bool) -> Path:
    from dsv4flash_bridge.synthetic import write_release_checkpoint

    from dsv4flash.integrations.mbridge import save_release

    config = text_only_config(root / "cfg", engram=engram)
    synthetic = write_release_checkpoint(root / "synthetic", config, shards=2, seed=5)
    return save_release(_canonical_scales(synthetic), synthetic, root / "release")


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """The text-only tiny config without Engram layers as a 2-shard release checkpoint."""
    return _release_checkpoint(tmp_path_factory.mktemp("v41"), engram=False)


@pytest.fixture(scope="module")
def engram_release(tmp_path_factory) -> Path:
    """The text-only tiny config with its Engram layers (1 and 4) as a 2-shard release checkpoint."""
    return _release_checkpoint(tmp_path_factory.mktemp("v41_engram"), engram=True)


def _canonical_scales(directory: Path):
    """(name, stored tensor) with every quantized weight re-encoded with the scale its block's amax gives.

    A quantizer that sees only decoded values (megatron-bridge's like-scale export) can reproduce such a scale and
    no other; the synthetic writer draws scales that are not all canonical. A block whose rounded amax lands on
    the next lower scale is re-encoded once more, until the stored bytes are a fixed point.
    """
    from dsv4flash.release.quant_plan import quant_role, scale_name
    from dsv4flash_bridge import codecs

    _QUANTIZED = _quantized_roles()
    stored = _stored(directory)
    quantized = {n for n in stored if quant_role(n) in _QUANTIZED and not n.endswith(".scale")
                 and scale_name(n) in stored}
    for name in sorted(quantized):
        role = quant_role(name)
        q, s = stored[name], stored[scale_name(name)]
        for _ in range(4):
            q2, s2 = codecs.encode(role, codecs.decode(role, q, s, name=name), name=name)
            if torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2.view(torch.uint8),
                                                                                       s.view(torch.uint8)):
                break
            q, s = q2, s2
        yield name, q
        yield scale_name(name), s
    done = quantized | {scale_name(n) for n in quantized}
    for name, tensor in stored.items():
        if name not in done:
            yield name, tensor


def _quantized_roles():
    from dsv4flash.release.quant_plan import QuantRole

    return (QuantRole.DENSE_FP8, QuantRole.EXPERT_MXFP4, QuantRole.ENGRAM_FP8)


def _bridge(release: Path):
    """`AutoBridge` over the checkpoint, dispatched to the patch's `DeepSeekV41Bridge` (the project's own
    `DSV41Bridge` registers for the same architecture; the last registration wins)."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge, get_model_bridge
    from megatron.bridge.models.deepseek_v41 import DeepSeekV41Bridge, DeepSeekV41ModelProvider
    from megatron.core.models.gpt.gpt_model import GPTModel

    from dsv4flash.integrations.mbridge import ReleasePretrained

    if not isinstance(get_model_bridge(SOURCE), DeepSeekV41Bridge):
        MegatronModelBridge.register_bridge(source=SOURCE, target=GPTModel, provider=DeepSeekV41ModelProvider,
                                            model_type="deepseek_v41")(DeepSeekV41Bridge)
    auto = AutoBridge(ReleasePretrained(release))
    assert isinstance(auto._model_bridge, DeepSeekV41Bridge)
    return auto


def _model(auto):
    """The megatron-core model of the checkpoint's provider, fp32, weights imported through the bridge."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    provider = auto.to_megatron_provider(load_weights=False)
    provider.params_dtype, provider.bf16 = torch.float32, False
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()  # as provide_distributed_model sets it
    model = provider.provide()
    auto.load_hf_weights([model])
    return model.eval()


def _decoded(directory: Path) -> dict[str, torch.Tensor]:
    from dsv4flash.release.quant_plan import quant_role, scale_name
    from dsv4flash_bridge import codecs, mapping
    from dsv4flash_bridge.sharded import CheckpointReader

    quantized = _quantized_roles()
    with CheckpointReader(directory) as ckpt:
        names = set(ckpt.names())
        return {n: (codecs.decode(quant_role(n), ckpt.read(n), ckpt.read(scale_name(n)), name=n)
                    if quant_role(n) in quantized else ckpt.read(n).float())
                for n in ckpt.names() if not mapping.is_carried_scale(n, names)}


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    from dsv4flash_bridge.sharded import CheckpointReader

    with CheckpointReader(directory) as ckpt:
        return {n: ckpt.read(n) for n in ckpt.names()}


def test_stock_release_has_no_v41_bridge():
    from dsv4flash.patching import twins
    from dsv4flash.cpu_mode.mbridge_import import install

    install()
    twin = twins.discover().get(PATCH_ID)
    with twin.suspended():
        assert importlib.util.find_spec("megatron.bridge.models.deepseek_v41") is None
        import megatron.bridge.models as models

        assert not any("V41" in name for name in dir(models))


def test_twin_runs_the_patch_files_byte_for_byte():
    from dsv4flash.integrations.mbridge.patches import deepseek_v41_bridge as twin
    from dsv4flash.patchseries.series import load_series

    added = {rel: text for rel, text in added_files(PATCH_ID).items() if rel.startswith(twin.FOLDER)}
    shipped = {str(p.relative_to(twin.UPSTREAM_SOURCES)): p.read_text()
               for p in (twin.UPSTREAM_SOURCES / twin.FOLDER).glob("*.py")}
    assert len(added) == 4 and set(added) <= set(shipped)
    # Files DSV41-MBRIDGE-006 edits afterwards ship as 006's patched tree leaves them (checked in its test); the
    # others byte for byte as this patch adds them.
    later = load_series(ROOT / "patches")["megatron-bridge"].by_id()["DSV41-MBRIDGE-006"]
    for rel, text in added.items():
        if rel not in later.files:
            assert shipped[rel] == text, rel


def test_release_fields_become_the_csa2_layer_pattern(patch_form, v41, release):
    from megatron.bridge.models.deepseek_v41 import csa2_layer_pattern_from_hf

    from dsv4flash.config import load_config

    cfg = load_config(release / "config.json")
    text = cfg.text
    pattern = csa2_layer_pattern_from_hf(text.compress_ratios[:text.num_hidden_layers], text.kv_source_layer_ids,
                                         text.index_source_layer_ids, text.candidate_source_layer_id)
    assert pattern == "SSFRFRCRIRIR"
    # The release plan agrees layer by layer (full = F, or C where it is the candidate source that later reindex
    # layers read; reindex = I, reuse = R, swa = S).
    kinds = {"swa": "S", "full": "F", "reindex": "I", "reuse": "R"}
    readers = any(p.uses_candidates for p in cfg.backbone_plan)
    assert pattern == "".join("C" if p.is_candidate_source and readers else kinds[p.mode] for p in cfg.backbone_plan)
    patch_form.record("pattern", pattern)


def test_release_parts_not_mapped_yet_are_refused_by_name(patch_form, v41):
    from megatron.bridge.models.deepseek_v41.deepseek_v41_bridge import provider_kwargs_from_hf

    tiny = _tiny()
    errors = []
    # The vision tower is refused by 001's tree and mapped once DSV41-MBRIDGE-006 is applied (the twin's shared
    # files carry it), so it is not part of this both-forms record: test_mbridge_deepseek_v41_vision.py covers it.
    for edit, field in ((lambda c: c["vision_config"].update(num_hidden_layers=0), None),
                        (lambda c: c["text_config"].update(num_nextn_predict_layers=1),
                         "text_config.num_nextn_predict_layers"),
                        (lambda c: c["text_config"].update(num_nextn_predict_layers=0, engram_head_dim=None),
                         "text_config.engram_head_dim")):
        edit(tiny)
        if field is None:  # the tiny text decoder with its Engram layers is mapped
            assert provider_kwargs_from_hf(tiny)["engram_layer_ids"] == [1, 4]
            continue
        with pytest.raises(ValueError, match=field.replace(".", r"\.")) as info:
            provider_kwargs_from_hf(tiny)
        errors.append(str(info.value))
    patch_form.record("errors", errors)


@pytest.fixture(params=["text", "engram"])
def checkpoint(request):
    """Each release checkpoint: without and with Engram layers."""
    return request.getfixturevalue("release" if request.param == "text" else "engram_release")


@pytest.mark.slow
def test_autobridge_import_gives_the_reference_logits(patch_form, v41, mcore_parallel, checkpoint, monkeypatch):
    from megatron.bridge.models.deepseek_v41 import deepseek_v41_bridge
    from megatron.bridge.models.deepseek_v41.deepseek_v41_engram import EngramHyperConnectionTransformerLayer
    from megatron.bridge.models.hf_pretrained.state import StateDict

    from dsv4flash.model import attention, indexer
    from dsv4flash.model.transformer import Transformer

    release = checkpoint
    reads = []
    load_rows = StateDict.load_rows
    monkeypatch.setattr(deepseek_v41_bridge, "ENGRAM_ROWS_PER_READ", 100)
    monkeypatch.setattr(StateDict, "load_rows", lambda self, key, start, stop: (
        reads.append((key, start, stop)), load_rows(self, key, start, stop))[1])
    auto = _bridge(release)
    model = _model(auto)
    assert [layer.self_attention.role.kind for layer in model.decoder.layers] == list("SSFRFRCRIRIR")
    engram_layers = [i for i, layer in enumerate(model.decoder.layers)
                     if isinstance(layer, EngramHyperConnectionTransformerLayer)]
    rows = {f"layers.{i}.engram.embed.weight": n for i, n in zip((1, 4), (462, 630))}
    if "engram" in release.parent.name:
        assert engram_layers == [1, 4]
        for i in engram_layers:  # the tables live in DSV41-MCORE-006's pinned-host row-lookup table
            table = model.decoder.layers[i].engram.embed
            assert type(table).__name__ == "HostRowLookupTable" and table.weight.host_resident
        # Every table row came through DSV41-MBRIDGE-003's row reads, 100 rows (and their scales) at a time.
        for name, total in rows.items():
            got = [(a, b) for key, a, b in reads if key == name]
            assert got == [(a, min(a + 100, total)) for a in range(0, total, 100)], name
            assert [(a, b) for key, a, b in reads if key == name.replace(".weight", ".scale")] == got
    else:
        assert engram_layers == [] and not reads
    assert model.config.csa2_yarn_factor == 4
    reference = Transformer(str(release / "config.json"), seed=None)
    reference.load_state_dict(_decoded(release), strict=True)
    for module, name in ((attention, "fake_quant_window_kv"), (attention, "fake_quant_compressed_kv"),
                         (indexer, "fake_quant_index")):
        monkeypatch.setattr(module, name, lambda x: x)  # DSV41-MCORE-008 has no fake-quant points
    # 40 tokens: past the YaRN original context (32) and several candidate blocks deep.
    ids = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(40).expand(2, -1)
    with torch.no_grad():
        got = model(ids, positions, attention_mask=None).float()  # [b, s, vocab]
        want = reference.eval()(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    patch_form.record("logits", got, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_export_is_bit_exact_to_the_release_tensors(patch_form, v41, mcore_parallel, checkpoint, monkeypatch):
    from megatron.bridge.models.deepseek_v41 import deepseek_v41_bridge
    from megatron.bridge.models.hf_pretrained.row_chunks import TensorRowChunk

    from dsv4flash.release.quant_plan import QuantRole, quant_role

    release = checkpoint
    auto = _bridge(release)
    model = _model(auto)
    monkeypatch.setattr(deepseek_v41_bridge, "ENGRAM_ROWS_PER_READ", 100)
    exported, chunks = {}, []
    for name, tensor in auto.export_hf_weights([model], show_progress=False):
        if isinstance(tensor, TensorRowChunk):  # Engram tables stream as row chunks, weight then scale
            chunks.append((name, tensor.start, tensor.rows.shape[0], tensor.total))
            assert tensor.start == (exported[name].shape[0] if name in exported else 0), name
            exported[name] = tensor.rows if tensor.start == 0 else torch.cat([exported[name], tensor.rows])
        else:
            exported[name] = tensor
    want = []
    for layer, total in ((1, 462), (4, 630)) if "engram" in release.parent.name else ():
        for start in range(0, total, 100):
            for part in ("weight", "scale"):
                want.append((f"layers.{layer}.engram.embed.{part}", start, min(100, total - start), total))
    assert chunks == want
    stored = _stored(release)
    assert exported.keys() == stored.keys()
    roles = set()
    for name, tensor in stored.items():
        got = exported[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), name
        roles.add(quant_role(name))
    assert {QuantRole.DENSE_FP8, QuantRole.EXPERT_MXFP4} <= roles
    assert (QuantRole.ENGRAM_FP8 in roles) == ("engram" in release.parent.name)
    patch_form.record("exported_names", sorted(exported))
