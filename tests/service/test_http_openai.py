"""The OpenAI-compatible routes of `dsv4flash serve` as the real `openai` client uses them: models listed per
tenant, completions and chats (streamed and whole) whose greedy tokens equal the tinker SDK's `sample` of the same
adapter under every name of it, three adapters at once equal to one at a time, another tenant's unpublished
adapter not found, bad fields named, and the tenant's request bound as a 429 with Retry-After."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import openai
import pytest
from tinker import types

from tests.service.http_server import KEYS, rest_client, running_server, service_client, write_keys

MAX_PENDING = 4  # the tenant bound of this module's server: a request of 5 prompts is refused whole
PROMPT = [0, 10, 11, 12]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One server; alice's run with three sampler checkpoints (one published) trained through the tinker SDK."""
    root = tmp_path_factory.mktemp("openai")
    with running_server(root / "store", write_keys(root / "keys"), args=("--max-pending", str(MAX_PENDING))) as srv, \
            service_client(srv, "alice") as sdk:
        tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
        paths = []
        for step in range(3):
            tokens = [0, 10 + step, 11, 12, 20 + step]
            tc.forward_backward([types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(4, np.float32)})],
                "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
            paths.append(tc.save_weights_for_sampler(f"a{step}").result().path)
        rest_client(srv, "alice").publish_checkpoint_from_tinker_path(paths[2]).result()
        run = paths[0].split("/")[2]
        yield dict(server=srv, sdk=sdk, paths=paths, run=run, names=[f"{run}:sampler_weights.a{i}" for i in range(3)],
                   store=root / "store")


def _client(world, tenant="alice", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{world['server'].url}/v1", api_key=KEYS[tenant], **kw)


def _ids(choice) -> list[int]:
    """The token ids of a completion choice asked with logprobs and return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def _tinker_greedy(world, path, prompt, max_tokens) -> list[int]:
    """The tinker SDK's greedy sample of `path`, the stop token (eos) cut as OpenAI's answers cut it."""
    sampler = world["sdk"].create_sampling_client(model_path=path).result()
    seq = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                         types.SamplingParams(max_tokens=max_tokens, temperature=0.0)).result().sequences[0]
    return list(seq.tokens[:-1] if seq.stop_reason == "stop" else seq.tokens)


def _tokenizer(world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(world["store"] / "service" / "hf_tokenizer")


def test_models_are_listed_per_tenant(world):
    alice = {m.id: m for m in _client(world).models.list().data}
    assert "tiny" in alice and set(world["names"]) <= set(alice)
    assert alice[world["names"][0]].parent == "tiny" and len(alice[world["names"][0]].root) == 64
    bob = {m.id for m in _client(world, "bob").models.list().data}
    assert "tiny" in bob and world["names"][2] in bob  # the published one
    assert not {world["names"][0], world["names"][1]} & bob
    client, pages, after = _client(world), [], None  # keyset pages: `limit` rows after `after`, then `has_more`
    while not pages or pages[-1].has_more:
        pages.append(client.models.list(extra_query={"limit": 2, **({"after": after} if after else {})}))
        assert len(pages[-1].data) == 2 or not pages[-1].has_more
        after = pages[-1].last_id
    assert [m.id for page in pages for m in page.data] == list(alice) and len(pages) == -(-len(alice) // 2)
    with pytest.raises(openai.BadRequestError, match=r"limit: expected an integer from 1 to 1000, got '0'"):
        client.models.list(extra_query={"limit": 0})


def test_greedy_completion_and_chat_equal_the_tinker_sample_under_every_name(world):
    client = _client(world)
    path = world["paths"][1]
    want = _tinker_greedy(world, path, PROMPT, 8)
    rev = {m.id: m.root for m in client.models.list().data}[world["names"][1]]
    for name in (world["names"][1], f"{world['run']}@{rev[:10]}", path):
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                        extra_body={"return_tokens_as_token_ids": True})
        assert _ids(out.choices[0]) == want, name
        assert out.usage.prompt_tokens == len(PROMPT) and out.model == name
        load = out.adapter_load[0]  # per prompt: how its adapter was had (the serving tiers' figure)
        assert load["tier"] in ("resident", "cpu", "disk", "loading") and load["wait_ms"] >= 0, load
    tok = _tokenizer(world)
    assert out.choices[0].text == tok.decode(want, skip_special_tokens=True)
    # a chat is the served template's prompt, the assistant turn opened
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 + 2 ?"}]
    prompt = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    want_chat = _tinker_greedy(world, path, prompt, 6)
    chat = client.chat.completions.create(model=world["names"][1], messages=messages, max_tokens=6, temperature=0,
                                          logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    assert [int(c.token.removeprefix("token_id:")) for c in chat.choices[0].logprobs.content] == want_chat
    assert chat.choices[0].message.content == tok.decode(want_chat, skip_special_tokens=True)
    assert chat.usage.prompt_tokens == len(prompt)
    # text prompts are encoded by the served tokenizer
    text = client.completions.create(model=world["names"][1], prompt="the cat", max_tokens=4, temperature=0)
    assert text.choices[0].text == tok.decode(_tinker_greedy(world, path, tok("the cat")["input_ids"], 4),
                                              skip_special_tokens=True)


def test_streamed_answers_equal_whole_ones(world):
    client = _client(world)
    kw = dict(model=world["names"][0], max_tokens=10, temperature=0.8, seed=7)
    whole = client.completions.create(prompt=[PROMPT, PROMPT[:2]], n=2, **kw)
    parts: dict[int, str] = {}
    finish, usage = {}, None
    for chunk in client.completions.create(prompt=[PROMPT, PROMPT[:2]], n=2, stream=True,
                                           stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
            assert [load["tier"] for load in chunk.adapter_load] == ["resident"] * 2  # whole answer just loaded it
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert [parts[i] for i in range(4)] == [c.text for c in whole.choices]
    assert [finish[i] for i in range(4)] == [c.finish_reason for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(messages=messages, **kw)
    deltas = [c.choices[0].delta for c in client.chat.completions.create(messages=messages, stream=True, **kw)]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == chat.choices[0].message.content


def test_a_stop_sequence_ends_the_choice_and_is_cut(world):
    client = _client(world)
    name = world["names"][0]
    ids = _ids(client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
                                         extra_body={"return_tokens_as_token_ids": True}).choices[0])
    k = next((i for i in range(1, len(ids)) if ids[i] not in ids[:i]), None)
    if k is None:
        pytest.fail(f"greedy tokens {ids} repeat one token: no stop token to pick")
    out = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True, "stop_token_ids": [ids[k]]})
    assert _ids(out.choices[0]) == ids[:k] and out.choices[0].finish_reason == "stop"
    # `stop` as a string: matched on the served tokenizer's encoding of it, and cut from the text
    tok = _tokenizer(world)
    k = next((i for i in range(1, len(ids)) if ids[i] not in ids[:i]
              and tok(tok.decode([ids[i]]), add_special_tokens=False)["input_ids"] == [ids[i]]), None)
    if k is None:
        pytest.fail(f"greedy tokens {ids}: none spells itself back as one token, no stop string to pick")
    out = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0,
                                    stop=[tok.decode([ids[k]])])
    assert out.choices[0].text == tok.decode(ids[:k], skip_special_tokens=True)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == k + 1  # the stop counted


def test_top_k_and_top_p_are_applied(world):
    """`top_k=1` or a `top_p` that keeps one token leaves only the most likely token at any temperature: the
    greedy tokens, each with log-prob 0 under the sampling distribution."""
    client = _client(world)
    kw = dict(model=world["names"][2], prompt=PROMPT, max_tokens=8, logprobs=0)
    greedy = _ids(client.completions.create(temperature=0, **kw,
                                            extra_body={"return_tokens_as_token_ids": True}).choices[0])
    for extra in ({"top_k": 1}, {"top_p": 1e-6}):
        top = {"top_p": extra.pop("top_p")} if "top_p" in extra else {}
        out = client.completions.create(temperature=1.5, seed=5, **kw, **top,
                                        extra_body={"return_tokens_as_token_ids": True, **extra})
        assert _ids(out.choices[0]) == greedy, (extra, top)
        assert out.choices[0].logprobs.token_logprobs == [0.0] * len(greedy)
    free = client.completions.create(temperature=1.5, seed=5, **kw, extra_body={"return_tokens_as_token_ids": True})
    assert free.choices[0].logprobs.token_logprobs != [0.0] * len(_ids(free.choices[0]))  # unnarrowed: it samples


def test_three_adapters_at_once_equal_one_at_a_time(world):
    client = _client(world)

    def ask(name):
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3,
                                        logprobs=0, extra_body={"return_tokens_as_token_ids": True})
        return _ids(out.choices[0]), out.choices[0].logprobs.token_logprobs

    alone = [ask(name) for name in world["names"]]
    assert len({tuple(lp) for _, lp in alone}) == 3  # three distinct adapters
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        together = list(pool.map(ask, world["names"]))
    assert [t for t, _ in together] == [t for t, _ in alone]
    np.testing.assert_allclose([lp for _, lp in together][0], alone[0][1], rtol=0, atol=1e-5)


def test_another_tenants_unpublished_adapter_is_not_found(world):
    bob = _client(world, "bob")
    rev = {m.id: m.root for m in _client(world).models.list().data}[world["names"][0]]
    for name in (world["names"][0], world["paths"][0], f"{world['run']}@{rev}", f"{world['run']}:head",
                 "nobody:sampler_weights.x"):
        with pytest.raises(openai.NotFoundError) as err:
            bob.completions.create(model=name, prompt=PROMPT, max_tokens=2)
        assert err.value.body["param"] == "model" and err.value.body["message"] == f"model {name!r} not found"
    published = {m.id: m.root for m in _client(world).models.list().data}[world["names"][2]]
    for name in (world["names"][2], world["paths"][2], f"{world['run']}@{published[:8]}"):  # published
        out = bob.completions.create(model=name, prompt=PROMPT, max_tokens=2)
        assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("field, body", [
    ("temperature", {"temperature": -1}),
    ("top_p", {"top_p": 0}),
    ("top_k", {"extra_body": {"top_k": -3}}),
    ("n", {"n": 0}),
    ("max_tokens", {"max_tokens": 0}),
    ("logprobs", {"logprobs": 50}),
    ("prompt", {"prompt": [0, 10, 10_000]}),
    ("max_tokens", {"max_tokens": 1000}),
    ("echo", {"echo": True}),
    ("model", {"model": "run@not-hex"}),
    ("frobnicate", {"extra_body": {"frobnicate": 1}}),
])
def test_a_bad_field_is_a_400_naming_it(world, field, body):
    args = {"model": world["names"][0], "prompt": PROMPT, "max_tokens": 2, **body}
    with pytest.raises(openai.BadRequestError) as err:
        _client(world, max_retries=0).completions.create(**args)
    assert err.value.body["param"] == field and err.value.body["message"].startswith(f"{field}:"), err.value.body


def test_chat_bad_fields_are_named(world):
    client = _client(world, max_retries=0)
    for field, kw in (("messages", {"messages": [{"role": "tool", "content": "x"}]}),
                      ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
                      ("top_logprobs", {"top_logprobs": 2})):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**{"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2, **kw})
        assert err.value.body["param"] == field, err.value.body


def test_past_the_tenant_bound_is_a_429_with_retry_after(world):
    client = _client(world, max_retries=0)
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model="tiny", prompt=[PROMPT] * (MAX_PENDING + 1), max_tokens=2)
    assert err.value.response.headers["retry-after"] == "1"
    assert err.value.body["type"] == "rate_limit_error"
    # a request that fits the bound runs; the client's own retry (on Retry-After) waits out any request of an
    # earlier test still finishing on a loaded machine
    out = _client(world, max_retries=8).completions.create(model="tiny", prompt=[PROMPT] * MAX_PENDING, max_tokens=2)
    assert len(out.choices) == MAX_PENDING and out.adapter_load == [None] * MAX_PENDING  # the base: no adapter


def test_keys_are_the_tinker_routes_keys(world):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{world['server'].url}/v1", api_key="tml-unknown", max_retries=0).models.list()
