"""CPU development mode: make megatron-core and megatron-bridge run on a CPU-only Python 3.11 machine.

`mcore_redirect` points megatron-core 0.19's CUDA-only calls at the CPU; `mbridge_import` lets megatron-bridge
0.6.2 import without Python 3.12 or Transformer Engine. Both change global state, so nothing here is imported
or installed implicitly: veRL's CPU platform (`dsv4flash.integrations.verl.cpu_platform`) and the tests call
their `install()`.
"""
