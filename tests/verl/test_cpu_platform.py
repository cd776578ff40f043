"""veRL's CPU development platform: registered by the plugin, selected by VERL_PLATFORM only, and a real
2-worker `RayWorkerGroup` on a local Ray cluster (127.0.0.1) comes up on it and all-reduces over gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.upstream]
ROOT = Path(__file__).resolve().parents[2]


def _probe(code: str, **env) -> str:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_plugin_registers_the_platform_and_only_verl_platform_selects_it():
    code = ("import verl; from verl.plugin.platform import PlatformRegistry, get_platform; "
            "print(PlatformRegistry.get('cpu').__name__, type(get_platform()).__name__)")
    assert _probe(code, VERL_PLATFORM="cpu") == "PlatformCPU PlatformCPU"
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**env, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-2:] != ["PlatformCPU", "PlatformCPU"]  # never auto-detected


def test_device_module_answers_what_verl_asks_of_torch_cuda():
    from tests.verl import _cpu_platform

    with _cpu_platform.platform("cpu") as p:
        dev = p.device_module
        assert p.device_name == "cpu" and p.communication_backend_name() == "gloo"
        assert p.ray_resource_name() == "CPU" and p.ray_resource_options(0.5) == {"num_cpus": 0.5}
        assert dev.current_device() == "cpu" and dev.device_count() == 1 and dev.is_available()
        assert dev.memory_allocated() == 0 and dev.max_memory_reserved() == 0
        free, total = dev.mem_get_info()
        assert 0 < free <= total
        dev.empty_cache(), dev.synchronize(), dev.set_device(0), dev.ipc_collect()
        state = dev.get_rng_state()
        dev.manual_seed(7)
        import torch

        a = torch.rand(3)
        dev.set_rng_state(state)
        dev.manual_seed(7)
        assert torch.equal(a, torch.rand(3))
        assert isinstance(dev.current_stream(), torch.cpu.Stream)  # the rest is torch.cpu's own


def test_refuses_to_run_where_a_cuda_device_is_visible(monkeypatch):
    import torch

    from dsv4flash.integrations.verl.cpu_platform import register_platform

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="VERL_PLATFORM=cpu .* a CUDA device is visible"):
        register_platform()()


@pytest.mark.slow
@pytest.mark.whole_machine  # a Ray cluster of its own (tests/_scheduling.py)
def test_two_worker_ray_group_all_reduces_over_gloo(monkeypatch):
    import ray
    from verl.single_controller.ray.base import RayClassWithInitArgs, RayWorkerGroup, ResourcePoolManager

    from ray import cloudpickle

    from tests.verl import _cpu_platform, _cpu_workers

    assert not ray.is_initialized()
    # Ray on the loopback interface only: without this it resolves 127.0.0.1 to the host's address (and
    # veRL's rendezvous address is Ray's node address; RayWorkerGroup drops master_addr/master_port kwargs
    # because WorkerGroup.__init__ resets them). The raylet and workers inherit the variable.
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
    # Workers inherit VERL_PLATFORM (veRL then loads the plugin's platform on `import verl`); gloo stays on lo.
    env = {"VERL_PLATFORM": "cpu", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cloudpickle.register_pickle_by_value(_cpu_workers)  # the test tree is not an installed package
    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": env}, log_to_driver=False)
    try:
        with _cpu_platform.platform("cpu"):
            pools = ResourcePoolManager(resource_pool_spec={"global_pool": [2]}, mapping={})
            pools.create_resource_pool()  # veRL's own resource check (DSV41-VERL-007) on the live cluster
            group = RayWorkerGroup(resource_pool=pools.resource_pool_dict["global_pool"],
                                   ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(_cpu_workers.AllReduceWorker)))
            results = group.all_reduce_rank()
    finally:
        ray.shutdown()
        cloudpickle.unregister_pickle_by_value(_cpu_workers)
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert r == {**r, "world": 2, "sum": 3.0, "backend": "cpu:gloo", "device": "cpu", "platform": "PlatformCPU",
                     "master_addr": "127.0.0.1"}


def test_verls_megatron_engines_are_registered_for_the_cpu_device():
    import verl  # noqa: F401  (loads the plugin, which schedules the registration)
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.megatron import transformer_impl

    from tests.verl import _cpu_platform

    lm = EngineRegistry._engines["language_model"]["megatron"]
    assert lm["cpu"] is lm["cuda"] is transformer_impl.MegatronEngineWithLMHead
    assert EngineRegistry._engines["value_model"]["megatron"]["cpu"] is transformer_impl.MegatronEngineWithValueHead
    with _cpu_platform.platform("cpu"):
        assert EngineRegistry.get_engine_cls("language_model", "megatron") is transformer_impl.MegatronEngineWithLMHead


@pytest.mark.slow
def test_cpu_development_mode_in_a_verl_worker_process():
    """What a veRL worker on the CPU platform gets once it imports veRL's Megatron engine: the megatron-core
    redirect, megatron-bridge importable on this Python, and the project's bridge registered with AutoBridge."""
    code = ("import json, torch, verl; import verl.workers.engine.megatron.transformer_impl; "
            "from dsv4flash.cpu_mode import mcore_redirect, mbridge_import; "
            "from dsv4flash.integrations import mbridge; "
            "print(json.dumps([mcore_redirect.installed(), mbridge_import._installed, mbridge.is_registered(), "
            "str(torch.cuda.current_device())]))")
    assert _probe(code, VERL_PLATFORM="cpu") == '[true, true, true, "cpu"]'
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    code_off = ("import json, verl; import verl.workers.engine.megatron.transformer_impl; "
                "from dsv4flash.cpu_mode import mcore_redirect; print(json.dumps(mcore_redirect.installed()))")
    run = subprocess.run([sys.executable, "-c", code_off], capture_output=True, text=True, timeout=300,
                         env={**env, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0 and run.stdout.strip().splitlines()[-1] == "false", run.stderr[-3000:]
