"""Policy service over the embedded engine, with Tinker's API (`import dsv4flash.service as tinker`).

ServiceClient → TrainingClient / SamplingClient; every call returns an `APIFuture`. See docs/service.md.
"""

from dsv4flash.service.client import ServiceClient
from dsv4flash.service.futures import APIFuture
from dsv4flash.service.compute.resident import ResidentBase
from dsv4flash.service.compute.sampling import SamplingClient
from dsv4flash.service.compute.shared_sampling import SharedSampling, sample_shared
from dsv4flash.service.compute.training import TrainingClient
from dsv4flash.service.types import (AdamParams, Datum, EncodedTextChunk, ForwardBackwardOutput, GetInfoResponse,
                                     LoadWeightsResponse, LoraConfig, ModelInput, OptimStepResponse,
                                     ParsedCheckpointTinkerPath, PromptProvenanceSpan, SampledProvenanceSpan,
                                     SampledSequence, SampleResponse, SamplingParams,
                                     SaveWeightsForSamplerResponse, SaveWeightsResponse, TensorData)
from dsv4flash.service import types

__all__ = ["ServiceClient", "TrainingClient", "SamplingClient", "APIFuture", "ResidentBase", "AdamParams", "Datum",
           "EncodedTextChunk", "ForwardBackwardOutput", "GetInfoResponse", "LoadWeightsResponse", "LoraConfig",
           "ModelInput", "OptimStepResponse", "ParsedCheckpointTinkerPath", "SampledSequence", "SampleResponse",
           "SamplingParams", "SaveWeightsForSamplerResponse", "SaveWeightsResponse", "TensorData", "types",
           "SharedSampling", "sample_shared", "PromptProvenanceSpan", "SampledProvenanceSpan"]
