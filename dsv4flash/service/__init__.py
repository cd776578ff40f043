"""Policy service over the embedded engine, with Tinker's API (`import dsv4flash.service as tinker`).

ServiceClient → TrainingClient / SamplingClient; every call returns an `APIFuture`. See docs/service.md.
Names are imported when first used, so `dsv4flash serve --help` (which imports `dsv4flash.service.protocol`)
answers without importing torch.
"""

from __future__ import annotations

import importlib

_TYPES = ("AdamParams", "Datum", "EncodedTextChunk", "ForwardBackwardOutput", "ModelInput",
          "ParsedCheckpointTinkerPath", "PromptProvenanceSpan", "SampledProvenanceSpan", "SampledSequence",
          "SampleResponse", "SamplingParams", "TensorData")
_EXPORTS = {
    "ServiceClient": "dsv4flash.service.client",
    "APIFuture": "dsv4flash.service.futures",
    "ResidentBase": "dsv4flash.engine.resident",
    "SamplingClient": "dsv4flash.service.compute.sampling",
    "SharedSampling": "dsv4flash.service.compute.shared_sampling",
    "sample_shared": "dsv4flash.service.compute.shared_sampling",
    "TrainingClient": "dsv4flash.service.compute.training",
    **{name: "dsv4flash.service.types" for name in _TYPES},
}

__all__ = ["ServiceClient", "TrainingClient", "SamplingClient", "APIFuture", "ResidentBase", "AdamParams", "Datum",
           "EncodedTextChunk", "ForwardBackwardOutput", "ModelInput", "ParsedCheckpointTinkerPath", "SampledSequence",
           "SampleResponse", "SamplingParams", "TensorData", "types",
           "SharedSampling", "sample_shared", "PromptProvenanceSpan", "SampledProvenanceSpan"]


def __getattr__(name: str):
    if name == "types":
        return importlib.import_module("dsv4flash.service.types")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dsv4flash.service' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
