"""Runtime twin of DSV41-VERL-003: unmerged syncs spell base weights the way the live vLLM loader wants.

Why: during a merge=False sync veRL reconciles `.base_layer.` in incoming base-weight names with
`resolve_weight_name`, which decides from a vLLM-version flag (`BaseLayerWithLoRA.load_weights` present) and
a `.mlp.experts.` naming convention instead of asking the model. DeepSeek-V4/V4.1 name experts `.ffn.experts.`
and their loaders accept both spellings, generic `AutoWeightsLoader` models on vLLM 0.33 only the plain one,
and released vLLM before 0.33 only the `.base_layer.` one; a wrong guess drops or misroutes base weights. The
FP8/MXFP4 path (`load_quanted_weights`, the V4.1 path) skips the reconciliation entirely.

How: `dsv4flash.integrations.verl.weight_names` dry-runs the live `model.load_weights` once per model (every
parameter's `weight_loader` is swapped for a recorder, nothing is written) and keeps the spelling that lands on
a `.base_layer.` parameter. `resolve_weight_name` in the rollout worker and the names handed to
`load_quanted_weights` during an unmerged sync both go through it.
"""

from __future__ import annotations

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.verl.patches import verl_twin

TOUCHES = (
    "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension._update_weights",
    "verl.workers.rollout.vllm_rollout.utils.resolve_weight_name",
)


def upstream_probes_loader() -> bool:
    """Probe: does veRL's rollout worker reconcile names by asking the loader (`probe_loader_naming`)?"""
    from verl.workers.rollout.vllm_rollout import utils

    return hasattr(utils, "probe_loader_naming")


@verl_twin(
    patch_id="DSV41-VERL-003",
    touches=TOUCHES,
    gate="DSV4FLASH_VERL_BASE_LAYER_NAMING",
    tests=("tests/verl/test_weight_names.py",),
    upstream_has_it=upstream_probes_loader,
)
def install(patcher: Patcher) -> None:
    """Probe-based `resolve_weight_name`, and probed names for the quantized unmerged path."""
    from verl.workers.rollout.vllm_rollout import utils

    from dsv4flash.integrations.verl.weight_names import resolve_names

    def resolve_weight_name(model, name: str, model_weight_names=None) -> str:
        """The spelling of `name` the live loader accepts (probed once per model)."""
        return resolve_names(model, [name])[0]

    update = utils.vLLMColocateWorkerExtension._update_weights

    def _update_weights(self, weights, peft_config, base_sync_done):
        """Unmerged base sync into a quantized model: probe-resolved names before `load_quanted_weights`."""
        if peft_config and not base_sync_done and utils.is_quantized_model(self.model_runner.vllm_config):
            weights = list(weights)
            names = resolve_names(self.model_runner.model, [n for n, _ in weights])
            weights = [(n, t) for n, (_, t) in zip(names, weights)]
        return update(self, weights, peft_config, base_sync_done)

    patcher.replace(utils, "resolve_weight_name", resolve_weight_name)
    patcher.replace(utils.vLLMColocateWorkerExtension, "_update_weights", _update_weights)
