"""The `dsv4flash` rollout backend: reference-engine generation behind veRL's rollout interfaces, unmerged LoRA
sync through veRL's weight-sync call, compact routes that expand to the Megatron rows via the project's replay.

The Ray test drives veRL's own `LLMServerManager` (which builds the replicas from `RolloutReplicaRegistry`,
starts their servers with `init_hybrid` and its load balancer) and `LLMServerClient.generate` (what the agent
loop calls) on a local Ray cluster bound to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.upstream]
ROOT = Path(__file__).resolve().parents[2]
LORA = {"rank": 16, "alpha": 32}  # alpha = 2·rank; 1.2 MiB of factors: two 1 MiB sync buckets


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    from dsv4flash.config import load_config
    from dsv4flash.engine import model_io
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks.tokenizer import TaskTokenizer

    cfg = load_config("tiny")
    return model_io.save_base(Transformer(cfg, seed=0), cfg, TaskTokenizer(cfg),
                              tmp_path_factory.mktemp("rollout") / "base", {"kind": "test"})


def _lora_model(cfg, base_seed: int):
    """The reference model on base `base_seed` with a decoder-half LoRA (fixed random non-zero factors)."""
    from dsv4flash.lora import LoraConfig, apply_lora, lora_parameters
    from dsv4flash.model.transformer import Transformer

    model = Transformer(cfg, seed=base_seed)
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    apply_lora(model, LoraConfig(preset="decoder_half", rank=LORA["rank"], alpha=LORA["alpha"]))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval(), base


@pytest.fixture(scope="module")
def reference(base_dir):
    """The base directory's model with the LoRA, and the bridge's tensors of that LoRA."""
    from dsv4flash.engine import model_io
    from dsv4flash.lora import lora_state_dict, to_layout

    model, _ = _lora_model(model_io.base_config(base_dir), base_seed=0)  # the seed base_dir was saved with
    # per-expert 2-D factors in release names: what DSV41Bridge.stream_adapter_weights_megatron_to_hf yields
    tensors = dict(to_layout(lora_state_dict(model), "megatron").tensors)
    return model, {k: v.clone() for k, v in tensors.items()}


def _image(seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))


def _prompt(cfg, with_image: bool) -> list[int]:
    ids = [5, 17, 42, 99, 3, 250, 77]
    return ids[:3] + [cfg.image_token_id] + ids[3:] if with_image else ids


def _reference_logprobs(model, prompt: list[int], images: list, response: list[int]):
    """Log-probs of `response` after `prompt` by one full forward, and the routes every gate chose on it."""
    from dsv4flash.model.image import TEXT, prepare_vl_inputs
    from dsv4flash.replay.reference import record_routes

    if images:
        ids, types, inputs = prepare_vl_inputs(prompt + response, images, model.cfg, dtype=torch.float32)
    else:
        ids = torch.tensor(prompt + response)
        types, inputs = torch.full_like(ids, TEXT), []
    with torch.no_grad(), record_routes(model) as records:
        logits = model(ids[None], types[None], inputs)[0]  # [S_e, V]
    n = len(response)
    lp = torch.log_softmax(logits[-n - 1:-1].float(), -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
    return lp, torch.stack(records, dim=1), types  # [T], [S_e, L, k], [S_e]


def _assert_routes_expand_to_reference(cfg, prompt, images, out, routes_ref, types_ref):
    """Compact server routes -> expanded Megatron rows (`dsv4flash.replay`): text rows equal the reference's."""
    from dsv4flash.model.image import image_token_types, llm_grid_hw, preprocess_image
    from dsv4flash.replay import ImageSpanLayout, expand_routes, r3_batch_keys

    routes = torch.from_numpy(np.array(out["routed_experts"])).long()
    compact = prompt + out["token_ids"]
    assert routes.shape == (len(compact) - 1, len(routes_ref[0]), routes_ref.shape[-1])
    spans = [image_token_types(*llm_grid_hw(preprocess_image(im, cfg, torch.float32).grid_hw,
                                            cfg.vision.downsample_ratio)).numel() for im in images]
    layout = ImageSpanLayout.from_compact_ids(torch.tensor(compact), cfg.image_token_id, spans)
    expanded, replayed = expand_routes(routes, layout)
    assert expanded.shape[0] == types_ref.numel() == layout.expanded_len
    rows = replayed.nonzero().flatten()
    assert rows.numel() == len(compact) - 1 - len(images)  # every text row but the last token, no image row
    assert torch.equal(expanded[rows], routes_ref[rows])
    assert not replayed[layout.image_rows()].any()
    keys = r3_batch_keys([layout], [routes.shape[0]])
    assert keys["r3_native_rows"].unbind()[0].sum() == sum(spans)


def test_engine_samples_the_synced_adapter_unmerged_and_records_compact_routes(base_dir, reference):
    from dsv4flash.integrations.verl.rollout.engine import RolloutEngine

    model, tensors = reference
    engine = RolloutEngine(base_dir)
    cfg = engine.cfg
    base_before = {k: v.clone() for k, v in engine.base.model.state_dict().items()}
    prompt, images = _prompt(cfg, True), [_image(0)]
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": 11}
    # the random tiny base is near uniform: a low temperature makes the adapter's shift visible in the tokens
    cold = {**params, "temperature": 0.1}
    plain = engine.generate(prompt, dict(cold), max_tokens=6, images=images, ignore_eos=True)
    engine.set_adapter(tensors, {"r": LORA["rank"], "lora_alpha": LORA["alpha"]})
    assert engine.generate(prompt, dict(cold), max_tokens=6, images=images, ignore_eos=True).token_ids != \
        plain.token_ids  # same seed: the adapter changes what is sampled
    out = engine.generate(prompt, dict(params), max_tokens=6, images=images, ignore_eos=True, record_routes=True)
    lp, routes_ref, types_ref = _reference_logprobs(model, prompt, images, out.token_ids)
    assert torch.allclose(torch.tensor(out.log_probs), lp, atol=1e-5, rtol=0)
    _assert_routes_expand_to_reference(cfg, prompt, images, {"routed_experts": out.routed_experts,
                                                            "token_ids": out.token_ids}, routes_ref, types_ref)
    after = engine.base.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items())  # never merged into the resident base
    # the packed 3-D expert form (veRL's packed-MoE flag / fused expert names) binds the same adapter
    from dsv4flash.lora import lora_state_dict

    engine.set_adapter(dict(lora_state_dict(model)), {"r": LORA["rank"], "lora_alpha": LORA["alpha"]})
    again = engine.generate(prompt, dict(params), max_tokens=6, images=images, ignore_eos=True)
    assert again.token_ids == out.token_ids and again.log_probs == out.log_probs and engine.version == 2


def test_an_expanded_prompt_is_served_as_its_compact_form(base_dir):
    """veRL's multimodal tokenization (the V4.1 HF processor) sends image spans expanded, as vLLM receives them:
    the same sample, log-probs and compact routes as the compact prompt; a count fitting neither form is refused."""
    from dsv4flash.integrations.verl.rollout.engine import RolloutEngine
    from dsv4flash.model.image import prepare_vl_inputs

    engine = RolloutEngine(base_dir)
    cfg = engine.cfg
    prompt, images = _prompt(cfg, True), [_image(0)]
    expanded = prepare_vl_inputs(prompt, images, cfg, dtype=torch.float32)[0].tolist()
    assert len(expanded) > len(prompt)
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": 5}
    a = engine.generate(prompt, dict(params), max_tokens=4, images=images, ignore_eos=True, record_routes=True)
    b = engine.generate(expanded, dict(params), max_tokens=4, images=images, ignore_eos=True, record_routes=True)
    assert a.token_ids == b.token_ids and a.log_probs == b.log_probs
    assert np.array_equal(a.routed_experts, b.routed_experts)
    with pytest.raises(ValueError, match="neither one placeholder per image .1. nor the images' expanded spans"):
        engine.generate(prompt[:3] + [cfg.image_token_id] * 2 + prompt[4:], dict(params), max_tokens=1,
                        images=images)


def test_prompt_logprobs_take_vllms_layout(base_dir, reference):
    """`prompt_logprobs` (veRL's teacher / scoring path): per prompt token 1 … S−1, then a dummy row."""
    from dsv4flash.integrations.verl.rollout.engine import RolloutEngine

    model, tensors = reference
    engine = RolloutEngine(base_dir)
    engine.set_adapter(tensors, {"r": LORA["rank"], "lora_alpha": LORA["alpha"]})
    prompt = _prompt(engine.cfg, False)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), -1)  # [S, V]
    exact = engine.generate(prompt, {"prompt_logprobs": 0}, max_tokens=1)
    assert exact.prompt_ids == [[t] for t in prompt[1:]] + [[0]]
    want = ref[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])
    assert torch.allclose(torch.tensor(exact.prompt_logprobs[:-1]), want, atol=1e-5) and exact.prompt_logprobs[-1] == [0.0]
    top = engine.generate(prompt, {"prompt_logprobs": 2}, max_tokens=1)
    assert top.prompt_ids[:-1] == ref[:-1].topk(2, -1).indices.tolist() and top.prompt_ids[-1] == [0, 0]
    # rollout.dtype=bfloat16 computes under BF16 autocast: the reference model under the same autocast
    bf16 = RolloutEngine(base_dir, dtype="bfloat16")
    bf16.set_adapter(tensors, {"r": LORA["rank"], "lora_alpha": LORA["alpha"]})
    low = torch.tensor(bf16.generate(prompt, {"prompt_logprobs": 0}, max_tokens=1).prompt_logprobs[:-1])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref_low = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), -1)[:-1]
    assert not torch.equal(low, want)
    assert torch.allclose(low, ref_low.gather(-1, torch.tensor(prompt[1:])[:, None]), atol=1e-5)


def test_top_k_and_top_p_shape_the_sampling_distribution(base_dir):
    """top-k / top-p go through `engine.sampling.Sampling` (`engine.sampling.process_logits`, as the service)."""
    from dsv4flash.integrations.verl.rollout.engine import RolloutEngine

    engine = RolloutEngine(base_dir)
    prompt = [5, 17, 42, 99]
    greedy = engine.generate(prompt, {"temperature": 0.0}, max_tokens=4, ignore_eos=True)
    top1 = engine.generate(prompt, {"temperature": 1.0, "top_k": 1, "seed": 2}, max_tokens=4, ignore_eos=True)
    assert top1.token_ids == greedy.token_ids and top1.log_probs == [0.0] * 4  # one token left: probability 1
    nucleus = engine.generate(prompt, {"temperature": 1.0, "top_p": 1e-6, "seed": 2}, max_tokens=4, ignore_eos=True)
    assert nucleus.token_ids == greedy.token_ids and nucleus.log_probs == [0.0] * 4


def test_base_sync_takes_the_release_layout_the_bridge_exports(base_dir, tmp_path):
    """FP8 / MXFP4 payloads with their `.scale` (what `DSV41Bridge` re-quantizes to), split across buckets."""
    from dsv4flash_bridge import codecs
    from dsv4flash_bridge.convert_common import QUANTIZED
    from dsv4flash_bridge.sharded import CheckpointReader
    from dsv4flash_bridge.synthetic import write_release_checkpoint

    from dsv4flash.integrations.verl.rollout.engine import RolloutEngine
    from dsv4flash.release.quant_plan import quant_role, scale_name

    release = write_release_checkpoint(tmp_path / "release", "tiny", shards=2, seed=7)
    with CheckpointReader(release) as ckpt:
        stored = [(n, ckpt.read(n)) for n in ckpt.names()]
    stored.sort(key=lambda item: item[0].endswith(".scale"))  # every scale after every payload: pairs span buckets
    engine = RolloutEngine(base_dir)
    half = len(stored) // 2
    written = engine.load_base_weights(stored[:half]) + engine.load_base_weights(stored[half:])
    engine.finish_base_sync()
    by_name = dict(stored)
    params = dict(engine.base.model.named_parameters())
    assert written == len(params)
    for name, param in params.items():
        role = quant_role(name)
        want = (codecs.decode(role, by_name[name], by_name[scale_name(name)], name=name)
                if role in QUANTIZED and by_name[name].element_size() == 1 else by_name[name].float())
        assert torch.equal(param, want), name
    assert any(quant_role(n).name == "EXPERT_MXFP4" for n in params)  # the MXFP4 experts were decoded too
    payload = next(n for n, _ in stored if quant_role(n) in QUANTIZED)
    engine.load_base_weights([(payload, by_name[payload])])
    with pytest.raises(ValueError, match=f"quantized tensors arrived without their other half: .*{payload}"):
        engine.finish_base_sync()


def test_bad_input_is_refused_by_name(base_dir, reference):
    from verl.workers.config import RolloutConfig

    from dsv4flash.integrations.verl.rollout.engine import RolloutEngine
    from dsv4flash.integrations.verl.rollout.replica import check_layout

    _, tensors = reference
    engine = RolloutEngine(base_dir)
    with pytest.raises(ValueError, match=r"unsupported sampling_params \['min_p'\]"):
        engine.generate([5, 6], {"min_p": 0.1}, max_tokens=2)
    with pytest.raises(ValueError, match="SamplingParams.top_p"):
        engine.generate([5, 6], {"top_p": 0.0}, max_tokens=2)
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer"):
        engine.generate([5, 6], {"prompt_logprobs": -1}, max_tokens=2)
    with pytest.raises(ValueError, match="position 1 is 9999"):
        engine.generate([5, 9999], {}, max_tokens=2)
    broken = {k: v for k, v in tensors.items() if "layers.6.attn.wq_a" not in k}
    with pytest.raises(ValueError, match="adapter sync: received adapter tensors do not form a reference placement"):
        engine.set_adapter({**broken, "layers.6.attn.wq_a.lora_A.weight": torch.zeros(4, 7),
                            "layers.6.attn.wq_a.lora_B.weight": torch.zeros(32, 4)}, {"r": 4, "lora_alpha": 8})
    with pytest.raises(ValueError, match="peft_config has no 'lora_alpha'"):
        engine.set_adapter(tensors, {"r": 4})
    with pytest.raises(KeyError, match="base sync: tensor 'layers.0.nope.weight'"):
        engine.load_base_weights([("layers.0.nope.weight", torch.zeros(1))])
    assert engine.adapter is None
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.dtype='float16': .* computes in one of"):
        RolloutEngine(base_dir, dtype="float16")
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.tensor_model_parallel_size=2: .* allowed: 1"):
        check_layout(RolloutConfig(name="dsv4flash", tensor_model_parallel_size=2))


def test_server_budget_and_full_determinism(base_dir):
    """The server in-process: vLLM's token budget and, with `full_determinism`, one seed per replica."""
    from verl.workers.config import RolloutConfig

    from dsv4flash.integrations.verl.rollout.server import DSV4FlashRolloutServer

    def server(**kw):
        s = DSV4FlashRolloutServer(RolloutConfig(name="dsv4flash", prompt_length=8, response_length=5, **kw),
                                   {"path": str(base_dir)}, rollout_mode=None, replica_rank=1)
        s.launch()
        return s

    def ask(s, prompt=(5, 6, 7), **params):
        return asyncio.run(s.generate(list(prompt), params, request_id="r")).token_ids

    plain = server(seed=3)
    assert len(ask(plain, ignore_eos=True)) == 5 and len(ask(plain, ignore_eos=True, max_tokens=2)) == 2
    assert len(ask(plain, prompt=[5] * 11, ignore_eos=True)) == 2  # prompt 8 + response 5: 2 tokens of room
    with pytest.raises(ValueError, match="prompt length 13 leaves no room within max_model_len 13"):
        ask(plain, prompt=[5] * 13)
    fixed = server(seed=3, full_determinism=True)
    assert ask(fixed) == ask(fixed) == ask(plain, seed=4)  # replica 1 + seed 3


def test_the_plugin_registers_the_backend_in_both_verl_registries():
    import verl  # noqa: F401  (loads the plugin)
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    from dsv4flash.integrations.verl.rollout import adapter, register, replica

    assert get_rollout_class("dsv4flash") is adapter.ServerAdapter
    assert get_rollout_replica_class("dsv4flash") is replica.DSV4FlashReplica
    register()  # idempotent
    assert get_rollout_class("dsv4flash") is adapter.ServerAdapter


def _verl_config(base_dir: Path):
    from dsv4flash.train.verl_config import compose_verl

    config = compose_verl(["actor_rollout_ref.rollout.name=dsv4flash", "actor_rollout_ref.rollout.dtype=float32",
                           "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                           "actor_rollout_ref.rollout.prompt_length=32", "actor_rollout_ref.rollout.response_length=6",
                           "actor_rollout_ref.rollout.enable_rollout_routing_replay=True",
                           "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1",
                           f"actor_rollout_ref.model.path={base_dir}"])
    return config


@pytest.mark.slow
@pytest.mark.whole_machine  # a Ray cluster of its own (tests/_scheduling.py)
def test_verl_replicas_serve_the_adapter_pushed_through_the_weight_sync(monkeypatch, tmp_path, base_dir, reference):
    import ray
    from ray import cloudpickle
    from verl.single_controller.ray.base import RayClassWithInitArgs, RayWorkerGroup, ResourcePoolManager
    from verl.workers.rollout.llm_server import LLMServerManager

    from tests.verl import _cpu_platform, _rollout_workers

    _, tensors = reference
    # veRL's first sync under load_format=dummy sends the full base first: a different base (seed 1) here, so
    # the served log-probs can only match if the base sync landed too
    model, synced_base = _lora_model(reference[0].cfg, base_seed=1)
    cfg = model.cfg
    config = _verl_config(base_dir)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only (see test_cpu_platform.py)
    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
    env = {"VERL_PLATFORM": "cpu", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cloudpickle.register_pickle_by_value(_rollout_workers)
    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": env}, log_to_driver=False)
    try:
        with _cpu_platform.platform("cpu"):
            pools = ResourcePoolManager(resource_pool_spec={"global_pool": [2]}, mapping={})
            pools.create_resource_pool()
            group = RayWorkerGroup(resource_pool=pools.resource_pool_dict["global_pool"],
                                   ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(_rollout_workers.RolloutSyncWorker),
                                                                          rollout_config=config.actor_rollout_ref.rollout))
            manager = LLMServerManager.create(config, worker_group=group)
            assert [type(r).__name__ for r in manager.rollout_replicas] == ["DSV4FlashReplica"] * 2
            client = manager.get_client()
            results = asyncio.run(_generate_sync_generate(client, manager.server_handles, group, cfg, tensors,
                                                          synced_base, config, tmp_path))
            results["parked"] = asyncio.run(_replica_controls(manager.rollout_replicas[0], cfg))
    finally:
        ray.shutdown()
        cloudpickle.unregister_pickle_by_value(_rollout_workers)

    prompt, images = _prompt(cfg, True), [_image(0)]
    for key in ("base", "adapter"):
        out = results[key]
        assert out["extra_fields"]["adapter_version"] == (0 if key == "base" else 1)
    assert results["adapter"]["extra_fields"]["global_steps"] == 3
    assert results["adapter_cold"]["token_ids"] != results["base"]["token_ids"]  # same seed: the adapter is sampled
    lp, routes_ref, types_ref = _reference_logprobs(model, prompt, images, results["adapter"]["token_ids"])
    assert torch.allclose(torch.tensor(results["adapter"]["log_probs"]), lp, atol=1e-5, rtol=0)
    _assert_routes_expand_to_reference(cfg, prompt, images, results["adapter"], routes_ref, types_ref)
    # concurrent requests (seeded) get exactly what each gets alone: no cross-talk of caches or route records
    assert results["concurrent"] == results["sequential"]
    # the adapter (1.2 MiB) crossed two 1 MiB buckets and was applied once, after the last
    assert results["syncs"] == [{"kind": "adapter", "buckets": 2, "tensors": len(tensors)}] * 2
    # both replicas serve the adapter their own worker pushed (one replica per rollout rank)
    assert results["replicas"] == [0, 1]
    assert [out["token_ids"] for out in results["per_server"]] == [results["adapter"]["token_ids"]] * 2
    # veRL's SingleTurnAgentLoop (chat template -> prompt ids -> the client -> merged response) on a text prompt
    loop = results["agent_loop"]
    lp, routes_ref, _ = _reference_logprobs(model, loop["prompt_ids"], [], loop["response_ids"])
    assert torch.allclose(torch.tensor(loop["response_logprobs"]), lp, atol=1e-5, rtol=0)
    routes = torch.from_numpy(np.array(loop["routed_experts"])).long()
    assert torch.equal(routes, routes_ref[: routes.shape[0]])
    assert routes.shape[0] == len(loop["prompt_ids"]) + len(loop["response_ids"]) - 1
    # a request admitted while the replica is aborted for a sync waits for resume_generation, then is served
    assert results["parked"]["waited"] and results["parked"]["token_ids"] == results["adapter"]["token_ids"]


async def _single_turn_agent_loop(client, config, cfg, tmp_path):
    """veRL's own SingleTurnAgentLoop on the client, with the task tokenizer in Hugging Face form."""
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from dsv4flash.tasks.hf_tokenizer import save_hf_tokenizer
    from dsv4flash.tasks.tokenizer import TaskTokenizer

    tokenizer = AutoTokenizer.from_pretrained(save_hf_tokenizer(TaskTokenizer(cfg), tmp_path / "hf_tokenizer"))
    agent = SingleTurnAgentLoop(trainer_config=DictConfigWrap(config), server_manager=client, tokenizer=tokenizer,
                                processor=None, dataset_cls=RLHFDataset, data_config=DictConfigWrap(config.data))
    rollout = config.actor_rollout_ref.rollout
    params = dict(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k, repetition_penalty=1.0,
                  logprobs=True)  # what AgentLoopWorker.generate_sequences sends
    out = await agent.run(sampling_params=params, raw_prompt=[{"role": "user", "content": "2 + 3 ="}])
    return {"prompt_ids": list(out.prompt_ids), "response_ids": list(out.response_ids),
            "response_logprobs": list(out.response_logprobs), "routed_experts": out.routed_experts}


async def _replica_controls(replica, cfg):
    """veRL's replica controls around a sync (CheckpointEngineManager's order) on the live servers."""
    prompt, images = _prompt(cfg, True), [_image(0)]
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True, "seed": 11}
    await replica.sleep()
    await replica.wake_up()
    await replica.abort_all_requests()
    await replica.release_kv_cache()
    await replica.resume_kv_cache()
    await replica.clear_kv_cache()

    async def ask():
        return await replica.server_handle.generate.remote(prompt_ids=prompt, sampling_params=dict(params),
                                                           request_id="parked", image_data=images)

    parked = asyncio.create_task(ask())
    await asyncio.sleep(2.0)
    waited = not parked.done()
    await replica.resume_generation()
    out = (await parked).model_dump()
    return {"waited": waited, "token_ids": out["token_ids"]}


async def _generate_sync_generate(client, servers, group, cfg, tensors, synced_base, config, tmp_path):
    """generate (base) -> veRL's unmerged LoRA sync from every worker -> generate (adapter), via veRL's client."""
    prompt, images = _prompt(cfg, True), [_image(0)]
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True, "seed": 11}

    async def ask(request_id, temperature=1.0, seed=11):
        out = await client.generate(request_id, prompt_ids=prompt, image_data=images,
                                    sampling_params={**params, "temperature": temperature, "seed": seed})
        return out.model_dump()

    base = await ask("base", temperature=0.1)  # low: the random tiny base is near uniform
    group.release()
    replicas = group.update_weights(tensors=tensors, lora=LORA, global_steps=3, base=synced_base)
    syncs = [await s.get_last_sync.remote() for s in servers]
    adapter_cold = await ask("adapter-cold", temperature=0.1)
    adapter = await ask("adapter")
    together = await asyncio.gather(*[ask(f"together-{i}", seed=i) for i in range(4)])  # the agent loop's way
    alone = [await ask(f"alone-{i}", seed=i) for i in range(4)]
    per_server = [(await s.generate.remote(prompt_ids=prompt, sampling_params=dict(params), request_id=f"direct-{i}",
                                           image_data=images)).model_dump() for i, s in enumerate(servers)]
    return {"base": base, "adapter_cold": adapter_cold, "adapter": adapter,
            "agent_loop": await _single_turn_agent_loop(client, config, cfg, tmp_path), "syncs": syncs,
            "concurrent": [(a["token_ids"], a["log_probs"], np.array(a["routed_experts"]).tolist()) for a in together],
            "sequential": [(a["token_ids"], a["log_probs"], np.array(a["routed_experts"]).tolist()) for a in alone],
            "per_server": per_server, "replicas": sorted(replicas)}
