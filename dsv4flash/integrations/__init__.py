"""Integrations with upstream frameworks (megatron-core, megatron-bridge, vLLM, veRL).

Each subpackage imports its framework lazily and registers idempotently; core modules never import
from here. Runtime twins of the upstream patch series live in `<integration>/patches/` and register with
`dsv4flash.patching.twins.REGISTRY`.
"""
