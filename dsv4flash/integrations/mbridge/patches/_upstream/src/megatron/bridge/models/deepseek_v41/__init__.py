# Copyright (c) 2026, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

from megatron.bridge.models.deepseek_v41.deepseek_v41_bridge import DeepSeekV41Bridge  # noqa: F401
from megatron.bridge.models.deepseek_v41.deepseek_v41_provider import (  # noqa: F401
    DeepSeekV41ModelProvider,
    csa2_layer_pattern_from_hf,
)
from megatron.bridge.models.deepseek_v41.deepseek_v41_vision import (  # noqa: F401
    DeepSeekV41VisionModel,
    DeepSeekV41VisionProjection,
)
from megatron.bridge.models.deepseek_v41.deepseek_v41_vl_model import DeepSeekV41VLModel  # noqa: F401


__all__ = [
    "DeepSeekV41Bridge",
    "DeepSeekV41ModelProvider",
    "DeepSeekV41VLModel",
    "DeepSeekV41VisionModel",
    "DeepSeekV41VisionProjection",
    "csa2_layer_pattern_from_hf",
]
