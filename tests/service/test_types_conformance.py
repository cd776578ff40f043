"""`dsv4flash.service.types` is the pinned tinker SDK's `tinker.types`: a Tinker name means Tinker's type, once."""

import inspect
import subprocess
import sys

import tinker.types as tinker_types

from dsv4flash.service import types

TINKER_NAMES = ("AdamParams", "Datum", "EncodedTextChunk", "ForwardBackwardOutput", "LossFnType", "ModelInput",
                "PromptProvenanceSpan", "SampledProvenanceSpan", "SampledSequence", "SampleResponse", "SamplingParams",
                "StopReason", "TensorData")


def test_the_core_speaks_tinker_s_own_types():
    for name in TINKER_NAMES:
        assert getattr(types, name) is getattr(tinker_types, name), f"dsv4flash.service.types.{name} is not tinker's"
    ours = {n for n, c in vars(types).items() if inspect.isclass(c) and c.__module__ == types.__name__}
    assert ours == {"CheckpointArchiveUrlResponse"}, f"type definitions beside tinker.types: {sorted(ours)}"
    assert not hasattr(tinker_types, "CheckpointArchiveUrlResponse")  # Tinker has none: the one type of our own
    import dsv4flash.service as service
    for name in TINKER_NAMES:
        if name in service.__all__:
            assert getattr(service, name) is getattr(tinker_types, name), name


def test_the_builders_give_what_the_sdk_reads():
    """The decode loop's lists, through the builders, read back through Tinker's own list properties."""
    seq = types.sampled_sequence("stop", [3, 4], [-0.5, -1.25], "s0", [[(3, -0.5)], [(4, -1.25)]])
    resp = types.sample_response([seq], [None, -2.0])
    assert (seq.tokens, seq.logprobs, seq.topk_logprobs, seq.sequence_id) == ([3, 4], [-0.5, -1.25],
                                                                            [[(3, -0.5)], [(4, -1.25)]], "s0")
    assert resp.prompt_logprobs == [None, -2.0] and resp.sequences[0] is seq


def test_the_parameter_checks_name_the_field():
    import math

    import pytest

    with pytest.raises(ValueError, match=r"AdamParams\.beta2: expected a finite number in \[0\.0, 1\.0\)"):
        types.check_adam_params(types.AdamParams(beta2=1.0))
    with pytest.raises(ValueError, match=r"AdamParams\.learning_rate"):
        types.check_adam_params(types.AdamParams(learning_rate=math.nan))
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p"):
        types.check_sampling_params(types.SamplingParams(top_p=0.0))
    types.check_adam_params(types.AdamParams())
    types.check_sampling_params(types.SamplingParams(max_tokens=4))


def test_the_package_and_the_engine_import_no_sdk():
    """`dsv4flash serve --help`, the engine and the integrations load without the `server` extra's SDK."""
    code = ("import sys, dsv4flash.service, dsv4flash.engine.sampling, dsv4flash.engine.resident; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tinker'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out
