"""Names of the layouts `export_adapter_dir` writes (torch-free, so `dsv4flash lifecycle --help` stays fast)."""

VLLM_3D = "vllm_3d"  # the fused 3-D MoE layout's name in the dsv4flash section
FORMATS = ("peft", "vllm", "megatron", "packed", VLLM_3D)
