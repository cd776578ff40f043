"""A dequantized checkpoint (a dsv4flash base: release names, fp32, no `.scale`) loads through `AutoBridge` as
veRL's Megatron engine loads it (`from_hf_pretrained` + `load_hf_weights`), Engram host tables included."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.upstream]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from dsv4flash.config import load_config
    from dsv4flash.engine.model_io import save_base
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks import TaskTokenizer

    cfg = load_config("tiny")
    model = Transformer(cfg, seed=4)
    path = save_base(model, cfg, TaskTokenizer(cfg), tmp_path_factory.mktemp("base") / "base", {"kind": "test"})
    return path, model


def test_autobridge_loads_a_dsv4flash_base_as_stored(mbridge, mcore, base):
    from megatron.bridge import AutoBridge

    from dsv4flash.hf.registration import register_config, register_models
    from dsv4flash.integrations.mcore.csa2 import load_reference_state

    path, reference = base
    register_config(), register_models()
    auto = AutoBridge.from_hf_pretrained(str(path))
    provider = auto.to_megatron_provider(load_weights=False)
    provider.finalize()
    model = provider.provide()
    auto.load_hf_weights([model])
    oracle = provider.provide()
    load_reference_state(oracle, reference.state_dict())
    got, want = model.state_dict(), oracle.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        if not name.endswith("._extra_state"):
            assert torch.equal(got[name], want[name]), name
    ids = torch.randint(0, 500, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), reference.eval()(ids), rtol=0, atol=1e-5)
