"""Expert parallelism over 2 gloo ranks: each rank holds half of every layer's routed experts.

Both ranks feed the same micro-batch (they are also the two data-parallel ranks), so the alltoall dispatcher
sends every token to the rank that owns its experts and back. Logits must equal the single-device reference;
a rank's routed-expert gradients are those of its experts summed over both ranks' (identical) tokens, i.e.
twice the reference's; every other gradient is the reference's.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import csa2_support as sup
from tests.mcore.layout_matrix import LAYOUT
from tests.mcore_cpu import parallel

pytestmark = [pytest.mark.upstream, pytest.mark.parity, pytest.mark.whole_machine]


def _ep_rank(rank: int, world_size: int, expected_path: str) -> None:
    """One EP rank: its experts' weights, full logits, expert gradients from both ranks' tokens."""
    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state

    torch.set_num_threads(1)
    expected = torch.load(expected_path)
    ref = sup.reference(seed=0)
    with parallel.model_parallel(ep=world_size, rank=rank, world_size=world_size, seed=1234):
        model = DSV41ModelProvider(ref.cfg).provide()
        load_reference_state(model, ref.state_dict(), ep_rank=rank, ep_size=world_size)
        model.train()
        assert model.decoder.layers[0].mlp.num_local_experts == ref.cfg.text.n_routed_experts // world_size
        out = model(expected["ids"])
        torch.testing.assert_close(out, expected["logits"], rtol=0, atol=2e-5)
        (out * expected["weights"]).sum().backward()
        sup.assert_ep_grads(ref, model, expected["grads"], rank, world_size)


@LAYOUT(ep=2, check="alltoall dispatcher: logits and every gradient (experts from both ranks' tokens)")
def test_two_rank_expert_parallel_equals_single_device(tmp_path):
    with sup.single_thread():
        path = tmp_path / "expected.pt"
        sup.save_reference_expectation(path, ids_seed=81, probe_seed=82)
        parallel.spawn_gloo(_ep_rank, 2, str(path))
