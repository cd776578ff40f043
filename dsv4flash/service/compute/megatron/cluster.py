"""The Ray cluster the compute plane runs on: `--ray-address local|auto|HOST:PORT`.

`local` starts a cluster inside the server process on 127.0.0.1 only (workers and gloo on the loopback
interface: a laptop, a CI machine); `auto` joins the cluster `ray start` made on this machine; HOST:PORT joins a
remote head. On a machine without CUDA the workers run veRL's CPU development mode (`VERL_PLATFORM=cpu`, gloo,
fp32: docs/verl.md), which the server selects for itself before veRL is imported.
"""

from __future__ import annotations

import os
import threading

_lock = threading.Lock()


def cuda_available() -> bool:
    """Whether torch sees a CUDA device here (the workers then run CUDA and bf16)."""
    import torch

    return torch.cuda.is_available()


def worker_env(cpu: bool, local: bool) -> dict[str, str]:
    """Environment every Ray worker of the plane gets."""
    env = {"TORCHDYNAMO_DISABLE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    if cpu:
        env.update({"VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if local:
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    for key in ("PYTHONPATH", "DSV4FLASH_STORE", "MKL_CBWR"):
        if os.environ.get(key):
            env[key] = os.environ[key]
    return env


def connect(address: str, *, num_cpus: int = 8) -> None:
    """Join (or, for `local`, start) the Ray cluster once per process; later calls are no-ops."""
    with _lock:
        import ray

        if ray.is_initialized():
            return
        cpu = not cuda_available()
        local = address == "local"
        if cpu:
            os.environ.setdefault("VERL_PLATFORM", "cpu")  # veRL reads it when first imported
        if local:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            # Ray on the loopback interface only; without this it resolves 127.0.0.1 to the host's address
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        runtime_env = {"env_vars": worker_env(cpu, local)}
        if local:
            ray.init(address="local", num_cpus=num_cpus, num_gpus=None if not cpu else 0, include_dashboard=False,
                     _node_ip_address="127.0.0.1", runtime_env=runtime_env, log_to_driver=False)
        else:
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=False)
