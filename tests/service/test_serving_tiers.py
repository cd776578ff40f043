"""The serving path of `dsv4flash serve` through the real tinker SDK: 16 adapters missing from the CPU tier,
requested at once, all complete with their loads overlapping; an adapter the others evicted is served again;
prewarm and /metrics; samples equal the same adapter sampled alone in-process."""

import concurrent.futures
import re

import httpx
import pytest
import torch

from dsv4flash.lora import LoraConfig

N_ADAPTERS = 16
PROMPT = [5, 17, 33, 9, 41]


def _publish(store_dir, resident, n=N_ADAPTERS):
    """`n` decoder-half adapters (ranks 2 and 4) published as policies trained outside the server."""
    from dsv4flash.lifecycle import AdapterStore, base_fingerprint

    store = AdapterStore(store_dir)
    fp = base_fingerprint(resident.cfg)
    out = {}
    for i in range(n):
        pc = LoraConfig(preset="decoder_half", rank=2 if i % 2 else 4, seed=i)
        gen = torch.Generator().manual_seed(i)
        tensors = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in resident.fresh_adapter(pc).items()}
        store.create_policy(f"pol{i}", fp, {"origin": "test"})
        store.publish(f"pol{i}", tensors, parent=None, tags=["latest"], extra={"placement": pc.to_dict()})
        out[f"pol{i}"] = (pc, tensors)
    return out


@pytest.fixture(scope="module")
def tiered(tmp_path_factory, resident):
    from tests.service.http_server import running_server, write_keys

    root = tmp_path_factory.mktemp("serving")
    adapters = _publish(root / "store", resident)
    args = ("--max-loras", "4", "--max-cpu-loras", "2", "--loader-workers", "4")
    with running_server(root / "store", write_keys(root / "keys"), args=args) as srv:
        yield srv, adapters


def _metrics(server) -> dict[str, float]:
    from tests.service.http_server import KEYS

    text = httpx.get(f"{server.url}/metrics", headers={"X-API-Key": KEYS["alice"]}, timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^dsv4flash_(\S+) (\S+)$", text, re.M)}


def _sample(service, name):
    from tinker import types

    client = service.create_sampling_client(model_path=f"tinker://{name}/weights/latest")
    client = client.result() if hasattr(client, "result") else client
    out = client.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=2,
                        sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0)).result(timeout=600)
    return [list(s.tokens) for s in out.sequences]


def test_cold_adapters_at_once_overlap_and_evicted_one_comes_back(tiered, resident):
    from dsv4flash.engine.sampling import Sampling, generate
    from dsv4flash.model.image import TEXT
    from tests.service.http_server import service_client

    server, adapters = tiered
    service = service_client(server)
    names = [f"pol{i}" for i in range(N_ADAPTERS)]
    with concurrent.futures.ThreadPoolExecutor(N_ADAPTERS) as pool:
        first = dict(zip(names, pool.map(lambda n: _sample(service, n), names)))
    m = _metrics(server)
    assert m['adapter_cache_hits_total{tier="disk"}'] >= N_ADAPTERS  # every one was cold
    assert m["cold_load_ms_count"] >= N_ADAPTERS
    assert m['adapter_loads_in_flight{stat="peak"}'] > 1  # loads overlapped in the loader pool
    assert m["cpu_cache_adapters"] <= 2 and m['slots{state="resident"}'] <= 4
    assert m["tokens_total"] >= N_ADAPTERS * 2 * 4 and m["decode_steps_total"] > 0

    # pol0 was evicted from the slots and the CPU tier by the 15 others: served again, from disk, same tokens
    disk_before = m['adapter_cache_hits_total{tier="disk"}']
    assert _sample(service, "pol0") == first["pol0"]
    assert _metrics(server)['adapter_cache_hits_total{tier="disk"}'] == disk_before + 1

    # the tokens are those of the adapter alone, in-process (temperature 0: the processed greedy of the service)
    for name in ("pol0", "pol7"):
        pc, tensors = adapters[name]
        row = (torch.tensor(PROMPT), torch.full((len(PROMPT),), TEXT), [])
        with resident.bind(pc, tensors) as model:
            ref = generate(model, [row] * 2, max_new_tokens=4, eos_id=None, pad_id=resident.cfg.pad_token_id,
                           sampling=Sampling(0.0, processed_greedy=True), generator=torch.Generator().manual_seed(0),
                           share_prefixes=False)
        assert first[name] == [ref.response(r) for r in range(2)], name


def test_a_cold_load_never_stalls_the_adapters_already_decoding(tmp_path, resident):
    """While one adapter's load is held up in the loader pool, another adapter's request keeps decoding: the load
    waits on its request's thread, never on the batcher's; then the held request joins and completes."""
    import threading
    import time

    import dsv4flash.service as core
    from dsv4flash.service.compute.sampling import SamplingClient
    from dsv4flash.service.types import ModelInput, SamplingParams, load_of

    service = core.ServiceClient(root=tmp_path, resident=resident)
    _publish(service.store.root, resident, n=2)
    revs = [service.store.resolve(f"pol{i}:latest").id for i in range(2)]
    serving = service.enable_serving(max_loras=2, max_cpu_loras=2, loader_workers=2, threads=8)
    loading, release = threading.Event(), threading.Event()
    prepare = serving.cache.prepare

    def held(loaded):  # pol1's load, in the loader pool, until pol0 has decoded on past it
        if loaded.id == revs[1]:
            loading.set()
            release.wait(120)
        return prepare(loaded)

    serving.cache.prepare = held
    steps = []
    try:
        first = SamplingClient(service, None, None, "a", revision=revs[0]).sample(
            ModelInput.from_ints(PROMPT), 1, SamplingParams(max_tokens=40, temperature=0.0),
            on_tokens=lambda *_: steps.append(time.monotonic()))
        deadline = time.monotonic() + 120
        while len(steps) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        second = SamplingClient(service, None, None, "b", revision=revs[1]).sample(
            ModelInput.from_ints(PROMPT), 1, SamplingParams(max_tokens=4, temperature=0.0))
        assert loading.wait(120), "pol1's load never started"
        during, deadline = len(steps), time.monotonic() + 120
        while len(steps) < during + 5 and not first.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(steps) > during and (len(steps) >= during + 5 or first.done()), "pol0 stopped decoding"
        assert not second.done()  # its load is still held
        release.set()
        assert len(second.result(timeout=300).sequences[0].tokens) == 4
        assert load_of(first.result(timeout=300))["tier"] == "disk" and load_of(second.result())["tier"] == "disk"
    finally:
        release.set()
        serving.close()


def test_prewarm_then_resident_and_unknown_names(tiered):
    from tests.service.http_server import KEYS

    server, _ = tiered
    headers = {"X-API-Key": KEYS["bob"]}
    r = httpx.post(f"{server.url}/v1/adapters/prewarm", json={"names": ["pol3:latest", "pol5"]}, headers=headers,
                   timeout=120)
    assert r.status_code == 200, r.text
    rows = r.json()["adapters"]
    assert [row["name"] for row in rows] == ["pol3:latest", "pol5"] and all(row["revision"] for row in rows)
    again = httpx.post(f"{server.url}/v1/adapters/prewarm", json={"names": ["pol3:latest"]}, headers=headers,
                       timeout=120).json()["adapters"][0]
    assert again["tier"] == "resident" and again["load_ms"] == 0
    missing = httpx.post(f"{server.url}/v1/adapters/prewarm", json={"names": ["nope:latest"]}, headers=headers,
                         timeout=30)
    assert missing.status_code == 404
    assert httpx.post(f"{server.url}/v1/adapters/prewarm", json={"names": []}, headers=headers,
                      timeout=30).status_code == 400
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 401


def test_full_slot_queue_is_429_with_retry_after():
    """The HTTP answer of `SlotQueueFull` (every slot held, the queue full): 429 and a Retry-After in seconds."""
    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from dsv4flash.lifecycle.errors import SlotQueueFull
    from dsv4flash.service.protocol.http import guarded

    async def busy(request):
        raise SlotQueueFull("all 4 adapter slots are busy and 64 requests already wait for one", 2.3)

    with TestClient(Starlette(routes=[Route("/busy", guarded(busy))])) as client:
        r = client.get("/busy")
    assert r.status_code == 429 and r.headers["retry-after"] == "3" and "slots are busy" in r.json()["detail"]


def test_a_full_slot_queue_is_a_rate_limit_error_the_openai_client_retries_through(tmp_path, resident):
    """One slot, no queue: while pol0 streams (holding the slot until its last token) a request for pol1 is a
    429 the `openai` client raises without retries and gets through with them, once the stream ends."""
    import openai

    from tests.service.http_server import KEYS, running_server, write_keys

    _publish(tmp_path / "store", resident, n=2)
    args = ("--max-loras", "1", "--max-slot-queue", "0")
    with running_server(tmp_path / "store", write_keys(tmp_path / "keys"), args=args) as srv:
        def client(retries):
            return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEYS["alice"], max_retries=retries)

        stream = iter(client(0).completions.create(model="pol0:latest", prompt=PROMPT, max_tokens=40,
                                                   temperature=0.0, stream=True))
        next(stream)  # pol0 decodes: its lease holds the one slot
        with pytest.raises(openai.RateLimitError) as err:
            client(0).completions.create(model="pol1:latest", prompt=PROMPT, max_tokens=2)
        assert err.value.response.headers["retry-after"].isdigit() and "slot" in err.value.body["message"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            retried = pool.submit(client(30).completions.create, model="pol1:latest", prompt=PROMPT, max_tokens=2)
            for _ in stream:  # the stream runs to its end and frees the slot
                pass
            answer = retried.result(timeout=300)
            assert answer.choices[0].finish_reason in ("length", "stop")
        load = answer.adapter_load[0]  # its adapter came from the store once the slot was free: the wait shows it
        assert load["tier"] == "disk" and load["load_ms"] > 0 and load["wait_ms"] >= load["load_ms"]
        assert _metrics(srv)["requests_rejected_total"] >= 1
