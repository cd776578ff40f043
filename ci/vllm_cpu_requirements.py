"""Print vllm's Requires-Dist minus the GPU-only packages, one requirement per line (pip -r format)."""
import re
import sys
import zipfile

# Packages vllm declares that are CUDA builds or only serve GPU kernels; torch comes from our pin,
# transformers/tokenizers/huggingface_hub from the verl-compatible pin (see ci/install_sides.md).
GPU_ONLY = {
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python",
    "apache-tvm-ffi", "tilelang", "nvidia-cudnn-frontend", "nvtx", "fastsafetensors", "instanttensor",
    "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla", "humming-kernels", "transformers",
    "tokenizers", "huggingface-hub", "xformers", "flash-attn", "deep-gemm", "deep-ep", "cupy-cuda12x",
    "nixl", "triton-kernels", "transformer-engine",
}


def requirements(wheel_path: str) -> list[str]:
    """Return the wheel's unconditional requirements that are usable on a CPU machine."""
    with zipfile.ZipFile(wheel_path) as wheel:
        meta_name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        meta = wheel.read(meta_name).decode()
    out = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec = line.split(":", 1)[1].strip()
        if "extra ==" in spec:
            continue
        name = re.split(r"[\s;<>=!~\[(]", spec, maxsplit=1)[0]
        if name.lower().replace("_", "-") in GPU_ONLY:
            continue
        out.append(spec)  # environment markers stay: pip evaluates them
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1])))
