"""DeepseekV41ForCausalLM through the real transformers Auto classes: config round trips, loading the
dsv4flash base format and the release layout (decoded by the bridge), and the bit-exact release save."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import dsv4flash  # noqa: F401  (registers the classes with transformers' auto classes)
from dsv4flash.config import load_config
from dsv4flash.engine import model_io
from dsv4flash.hf.checkpoint import CheckpointLayoutError, detect_layout
from dsv4flash.model.transformer import Transformer
from dsv4flash.tasks.tokenizer import TaskTokenizer
from dsv4flash_bridge.convert import import_release
from dsv4flash_bridge.safetensors_io import SafetensorsReader
from dsv4flash_bridge.sharded import CheckpointReader
from dsv4flash_bridge.synthetic import write_release_checkpoint

from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText  # noqa: E402

RELEASE_CONFIGS = {"flash": Path(dsv4flash.__file__).parent / "data" / "flash_config.json",
                   "tiny": Path(dsv4flash.__file__).parent / "data" / "tiny_config.json"}


@pytest.mark.parametrize("flavour", ["flash", "tiny"])
def test_config_round_trip_is_byte_identical(flavour, tmp_path):
    text = RELEASE_CONFIGS[flavour].read_text()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(text)
    config = AutoConfig.from_pretrained(tmp_path / "src")
    assert type(config).__name__ == "DeepseekV41Config" and config.model_type == "deepseek_v41"
    assert config.text_config.hidden_size == json.loads(text)["text_config"]["hidden_size"]
    assert config.get_text_config().vocab_size == json.loads(text)["text_config"]["vocab_size"]
    config.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_text() == text
    assert config.to_dsv4flash().to_hf() == load_config(flavour).to_hf()


def test_config_rejects_bad_values_naming_the_key(tmp_path):
    data = json.loads(RELEASE_CONFIGS["tiny"].read_text())
    data["text_config"]["o_groups"] = 3
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="text_config.o_groups"):
        AutoConfig.from_pretrained(tmp_path)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A dsv4flash base directory (what `python -m dsv4flash.train` caches) of a seeded tiny model."""
    cfg = load_config("tiny")
    model = Transformer(cfg, seed=7)
    return model_io.save_base(model, cfg, TaskTokenizer(cfg), tmp_path_factory.mktemp("base") / "model",
                              {"source": "test"})


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory) -> Path:
    """The tiny config's full census as a 3-shard release-format checkpoint (FP8, MXFP4, Engram FP8)."""
    return write_release_checkpoint(tmp_path_factory.mktemp("rel") / "release", "tiny", shards=3, seed=1)


def _text_and_image_logits(model, ref) -> None:
    """The HF model's logits equal the reference model's on a text and an image prompt."""
    from dsv4flash.model.image import ImageInput, expand_image_placeholders

    torch.manual_seed(0)
    cfg = ref.cfg
    ids = torch.randint(3, 400, (2, 12))
    assert torch.equal(model(ids).logits, ref(ids))
    image = ImageInput(torch.randn(9 * 9, 3 * 14 * 14), (9, 9))
    prompt = torch.tensor([5, 6, cfg.image_token_id, 7, 8])
    ids, types = expand_image_placeholders(prompt, [image], cfg)
    got = model(ids[None], token_types=types[None], images=[image]).logits
    assert torch.equal(got, ref(ids[None], types[None], [image]))


def test_from_pretrained_base_dir(base_dir):
    assert detect_layout(base_dir) == "base"
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    assert type(model).__name__ == "DeepseekV41ForCausalLM" and model.release_layout is None
    ref = Transformer(load_config("tiny"), seed=None)
    model_io.load_base_weights(ref, base_dir)
    assert set(dict(model.named_parameters())) == set(dict(ref.named_parameters()))  # release names, no prefix
    for name, param in ref.named_parameters():
        assert torch.equal(model.get_parameter(name), param), name
    _text_and_image_logits(model, ref.eval())
    image_text = AutoModelForImageTextToText.from_pretrained(base_dir)  # the release is a VLM as well
    assert type(image_text) is type(model) and torch.equal(image_text.head.weight, model.head.weight)


def test_base_save_round_trip_keeps_other_files(base_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    out = Path(shutil.copytree(base_dir, tmp_path / "copy"))
    model.save_pretrained(out)
    assert (out / "tokenizer.json").read_bytes() == (base_dir / "tokenizer.json").read_bytes()
    assert not (out / "base.json").exists()  # its digest would describe other weights
    again = AutoModelForCausalLM.from_pretrained(out)
    for name, param in model.named_parameters():
        assert torch.equal(again.get_parameter(name), param), name


def test_from_pretrained_release_decodes_through_the_bridge(release_dir, tmp_path):
    assert detect_layout(release_dir) == "release"
    model = AutoModelForCausalLM.from_pretrained(release_dir)
    imported = import_release(release_dir, tmp_path / "imported", dtype=torch.float32, progress=False)
    assert imported.tensors == len(list(model.parameters()))
    with CheckpointReader(tmp_path / "imported") as ckpt:
        for name, param in model.named_parameters():
            assert torch.equal(param, ckpt.read(name).float()), name
    # The import output loads too, with the same weights.
    assert detect_layout(tmp_path / "imported") == "import"
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "imported")
    for name, param in model.named_parameters():
        assert torch.equal(again.get_parameter(name), param), name
    ref = Transformer(load_config("tiny"), seed=None)
    ref.load_state_dict(dict(model.named_parameters()))
    _text_and_image_logits(model, ref.eval())


def _tensor_bytes(directory: Path) -> dict[str, bytes]:
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with SafetensorsReader(shard) as reader:
            for name in reader.names():
                out[name] = reader.read(name).reshape(-1).view(torch.uint8).numpy().tobytes()
    return out


def test_release_save_is_bit_exact(release_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(release_dir)
    model.save_pretrained(tmp_path / "saved")
    source = _tensor_bytes(release_dir)
    assert _tensor_bytes(tmp_path / "saved") == source
    for name in ("config.json", "model.safetensors.index.json"):
        assert (tmp_path / "saved" / name).read_bytes() == (release_dir / name).read_bytes()
    # A changed weight is written back changed (fresh scale for its blocks), the rest stays identical.
    with torch.no_grad():
        model.get_parameter("layers.3.attn.wq_a.weight").mul_(2.0)
    model.save_pretrained(tmp_path / "saved")
    changed = {k for k, v in _tensor_bytes(tmp_path / "saved").items() if v != source[k]}
    assert changed and all(k.startswith("layers.3.attn.wq_a.") for k in changed)


def test_release_with_dspark_blocks_round_trips(tmp_path):
    """tiny_mtp has three DSpark (`mtp.*`) blocks: every tensor family of the release is loaded and re-saved."""
    release = write_release_checkpoint(tmp_path / "release", "tiny_mtp", shards=2, seed=2)
    model = AutoModelForCausalLM.from_pretrained(release)
    assert any(name.startswith("mtp.2.") for name, _ in model.named_parameters())
    model.save_pretrained(tmp_path / "saved")
    assert _tensor_bytes(tmp_path / "saved") == _tensor_bytes(release)


def test_bfloat16_load_and_save_are_bit_exact_too(release_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(release_dir, dtype="auto", staging_dir=tmp_path)
    assert next(model.parameters()).dtype == torch.bfloat16 and list(tmp_path.iterdir()) == []
    model.save_pretrained(tmp_path / "saved")
    assert _tensor_bytes(tmp_path / "saved") == _tensor_bytes(release_dir)


def test_megatron_named_import_is_refused_clearly(release_dir, tmp_path):
    import_release(release_dir, tmp_path / "meg", naming="megatron", progress=False)
    with pytest.raises(CheckpointLayoutError, match="imported with --naming megatron"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "meg")


def test_wrong_checkpoint_names_the_tensor(base_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from dsv4flash_bridge.safetensors_io import SafetensorsError

    (tmp_path / "flash").mkdir()
    load_config("flash").save(tmp_path / "flash" / "config.json")
    with pytest.raises(SafetensorsError, match="neither model.safetensors.index.json nor model.safetensors"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "flash")  # fails before allocating the full model

    bad = Path(shutil.copytree(base_dir, tmp_path / "bad"))
    state = load_file(str(bad / "model.safetensors"))
    state.pop("layers.3.attn.wq_a.weight")
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointLayoutError, match="layers.3.attn.wq_a.weight is missing"):
        AutoModelForCausalLM.from_pretrained(bad)
    state["layers.3.attn.wq_a.weight"] = torch.zeros(3, 3)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointLayoutError, match=r"layers.3.attn.wq_a.weight has shape \[3, 3\]"):
        AutoModelForCausalLM.from_pretrained(bad)
