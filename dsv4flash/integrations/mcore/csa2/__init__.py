"""DeepSeek-V4.1 CSA2 layers for megatron-core 0.19: specs, stateful stack, model provider (docs/megatron.md).

Importing this package imports megatron-core. Entry points:

- `DSV41ModelProvider(cfg).provide()` -> `DSV41MegatronModel` (embedding, CSA2 block, fp32 head; under PP this
  rank's stage, exchanging the streams and CSA2 state as DSV41-MCORE-010's stage payload);
- `get_csa2_block_spec(config)` / `get_csa2_layer_spec(config, i)` for your own model class;
- `transformer_config_from(cfg, **overrides)` -> `CSA2TransformerConfig`;
- `load_reference_state(model, state)` loads release-named weights (`dsv4flash.model` state dicts).

The stack is built from the upstream-form megatron-core modules of the patch series (on a stock release their
twins provide them, `dsv4flash.integrations.mcore.require_stack_modules`).
"""

from dsv4flash.integrations.mcore import require_stack_modules

require_stack_modules()

from dsv4flash.integrations.mcore.csa2.block import CSA2TransformerBlock  # noqa: E402
from dsv4flash.integrations.mcore.csa2.carry import CSA2Context, CSA2Tokens  # noqa: E402
from dsv4flash.integrations.mcore.csa2.config import CSA2TransformerConfig, transformer_config_from  # noqa: E402
from dsv4flash.integrations.mcore.csa2.layer import CSA2TransformerLayer  # noqa: E402
from dsv4flash.integrations.mcore.csa2.model import DSV41MegatronModel  # noqa: E402
from dsv4flash.integrations.mcore.csa2.provider import DSV41ModelProvider, RECOMPUTE_PRESETS  # noqa: E402
from dsv4flash.integrations.mcore.csa2.specs import get_csa2_block_spec, get_csa2_layer_spec  # noqa: E402
from dsv4flash.integrations.mcore.csa2.weights import load_reference_state, name_map  # noqa: E402

__all__ = [
    "CSA2Context",
    "CSA2Tokens",
    "CSA2TransformerBlock",
    "CSA2TransformerConfig",
    "CSA2TransformerLayer",
    "DSV41MegatronModel",
    "DSV41ModelProvider",
    "RECOMPUTE_PRESETS",
    "get_csa2_block_spec",
    "get_csa2_layer_spec",
    "load_reference_state",
    "name_map",
    "transformer_config_from",
]
