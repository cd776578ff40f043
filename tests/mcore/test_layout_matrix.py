"""Layouts the CSA2 stack refuses fail at config time naming the key; the docs matrix is generated from the tests."""

from __future__ import annotations

import pytest
import torch

from tests.mcore.layout_matrix import LAYOUT

pytestmark = pytest.mark.upstream


@pytest.mark.parametrize("overrides, key", [
    pytest.param({"pipeline_model_parallel_size": 2, "pipeline_dtype": torch.float32}, "variable_seq_lengths",
                 id="pp-fixed-shape", marks=LAYOUT(pp=2, status="refused", key="variable_seq_lengths", reason=(
                     "must be True with PP > 1: the stage payload (streams + CSA2 state) is not "
                     "[s, b, hidden_size], so its shape is exchanged per micro-batch"))),
    pytest.param({"pipeline_model_parallel_size": 2, "pipeline_dtype": torch.bfloat16, "variable_seq_lengths": True},
                 "pipeline_dtype", id="pp-bf16-payload", marks=LAYOUT(pp=2, status="refused", key="pipeline_dtype",
                                                                      reason="must be torch.float32 with PP > 1 (fp32 "
                                                                      "pre_mix and integer top-k travel exactly)")),
    pytest.param({"pipeline_model_parallel_size": 2, "pipeline_dtype": torch.float32, "variable_seq_lengths": True,
                  "virtual_pipeline_model_parallel_size": 2, "num_layers_in_first_pipeline_stage": None},
                 "virtual_pipeline_model_parallel_size", id="vpp",
                 marks=LAYOUT(pp=2, status="refused", key="virtual_pipeline_model_parallel_size",
                              reason="interleaved (virtual) pipeline stages: the CSA2 stack and the early stop run "
                              "the non-interleaved 1F1B schedule")),
    pytest.param({"tensor_model_parallel_size": 2, "sequence_parallel": True}, "sequence_parallel", id="sp",
                 marks=LAYOUT(tp=2, status="refused", key="sequence_parallel",
                              reason="the CSA2 state is per sequence, not per sequence shard")),
])
def test_unsupported_layouts_fail_at_config_time_naming_the_key(overrides, key):
    from dsv4flash.integrations.mcore.csa2.config import transformer_config_from

    with pytest.raises(ValueError, match=key):
        transformer_config_from("tiny", **overrides)


def test_docs_matrix_is_generated_from_the_tests():
    from tests.mcore import layout_matrix

    rows = layout_matrix.collect()
    assert any(r.status == "refused" for r in rows) and any(r.pp > 1 and r.status == "equal" for r in rows)
    documented = layout_matrix.section(layout_matrix.DOC.read_text())
    assert documented == layout_matrix.render(rows), (
        "docs/megatron.md's layout matrix is stale: run `python tests/mcore/layout_matrix.py --write`")
