"""DSV41-VERL-003: unmerged sync names base weights the way the live loader wants (probed, not guessed)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from tests.vllm import _vllm_helpers as vh
from tests.vllm._twins import stock

PATCH_ID = "DSV41-VERL-003"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]


class _Model(nn.Module):
    """A LoRA-wrapped projection `proj` (real vLLM wrapper) next to a plain `other`; loader style chosen per case."""

    def __init__(self, style: str):
        super().__init__()
        from vllm.model_executor.layers.linear import ColumnParallelLinear

        base = ColumnParallelLinear(8, 4, bias=False, return_bias=False, params_dtype=torch.float32)
        with torch.no_grad():  # vLLM allocates with torch.empty: stale memory can hold NaN, which never equals itself
            base.weight.normal_()
        base.quant_method.process_weights_after_loading(base)
        self.proj = vh.wrap(base, max_loras=1, rank=8)
        self.other = nn.Linear(8, 4, bias=False)
        self.style = style

    def load_weights(self, weights):
        """generic: vLLM's AutoWeightsLoader; v41: V4.1's plain->base_layer fallback; strict: exact names only."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader
        from vllm.model_executor.models.utils import AutoWeightsLoader

        if self.style == "generic":
            return AutoWeightsLoader(self).load_weights(weights)
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, tensor in weights:
            if name not in params and self.style == "v41":
                head, _, leaf = name.rpartition(".")
                name = f"{head}.base_layer.{leaf}" if f"{head}.base_layer.{leaf}" in params else name
            param = params[name]  # KeyError for names this loader does not know
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded


NAMES = ["proj.weight", "proj.base_layer.weight", "other.weight"]


@pytest.mark.parametrize("style", ["generic", "v41", "strict"])
def test_resolved_names_load_into_the_wrapped_base(patch_form, vllm_cpu, style):
    """Both incoming spellings resolve to one the loader accepts, and the load reaches the base weight."""
    from verl.workers.rollout.vllm_rollout import utils

    model = _Model(style)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    resolved = [utils.resolve_weight_name(model, n, names) for n in NAMES]
    for i, name in enumerate(resolved[:2]):
        value = torch.full((4, 8), float(i + 1))
        model.load_weights([(name, value)])
        torch.testing.assert_close(model.proj.base_layer.weight.data, value)
    model.load_weights([(resolved[2], torch.full((4, 8), 5.0))])
    assert float(model.other.weight.data.mean()) == 5.0
    patch_form.record("resolved", resolved)


def test_quantized_unmerged_base_sync_resolves_names(patch_form, vllm_cpu, monkeypatch):
    """The FP8/MXFP4 path (`load_quanted_weights`) gets loader-accepted names too."""
    from verl.workers.rollout.vllm_rollout import utils

    model = _Model("strict")
    seen = []
    monkeypatch.setattr(utils, "is_quantized_model", lambda config: True)
    monkeypatch.setattr(utils, "load_quanted_weights", lambda updates, runner, **kw: seen.extend(n for n, _ in updates) or [])
    worker = object.__new__(utils.vLLMColocateWorkerExtension)
    worker.model_runner = types.SimpleNamespace(model=model, vllm_config=types.SimpleNamespace(speculative_config=None, quant_config="fp8"))
    utils.vLLMColocateWorkerExtension._update_weights(worker, [("proj.weight", torch.zeros(4, 8))],
                                                      peft_config={"r": 8}, base_sync_done=False)
    assert seen == ["proj.base_layer.weight"]
    patch_form.record("seen", seen)


def test_stock_resolver_guesses_wrong_for_a_strict_loader(vllm_cpu):
    """veRL 0.9.1 strips `.base_layer.` on vLLM 0.33 from the version flag alone; a strict loader then misses."""
    from verl.workers.rollout.vllm_rollout import utils

    model = _Model("strict")
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    with stock(PATCH_ID):
        resolved = utils.resolve_weight_name(model, "proj.base_layer.weight", names)
    assert resolved == "proj.weight"
    with pytest.raises(KeyError):
        model.load_weights([(resolved, torch.zeros(4, 8))])


def test_probe_writes_nothing(vllm_cpu):
    from dsv4flash.integrations.verl.weight_names import LoaderNaming

    model = _Model("v41")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    naming = LoaderNaming.probe(model, NAMES)
    assert naming.scheme == "either" and naming.probed_with == "proj.weight"
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)
        assert not hasattr(p, "weight_loader") or "lambda" not in repr(p.weight_loader)
    assert LoaderNaming.probe(_Model("strict"), NAMES).scheme == "base_layer"
    assert LoaderNaming.probe(_Model("generic"), NAMES).scheme in ("plain", "either")
