"""Helpers for the HTTP tests: API keys of three tenants, a running `dsv4flash serve`, SDK clients on it, RL data."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from dsv4flash.service.protocol.launch import ServerProcess as Server

KEYS = {"alice": "tml-alice-key-0123456789", "bob": "tml-bob-key-0123456789", "mallory": "sk-mallory-key-0123"}


def write_keys(path: Path) -> Path:
    """A keys file: alice and mallory by plain key, bob by stored hash (both formats the server reads)."""
    from dsv4flash.service.plane.keys import key_hash

    path.write_text(f"alice {KEYS['alice']}\n# bob is stored hashed\nbob sha256:{key_hash(KEYS['bob'])}\n"
                    f"mallory {KEYS['mallory']}\n")
    return path


# SDK clients made by service_client, per server: closed before their server stops, since an open client's
# heartbeat thread outlives the test and logs a warning every 10 s for the rest of the run.
_clients: dict[int, list] = {}


@contextlib.contextmanager
def running_server(store: Path, keys: Path, **kwargs):
    """A server for the duration of a `with` block."""
    server = Server(store, keys, **kwargs)
    try:
        yield server
    finally:
        for client in _clients.pop(id(server), []):
            # close() finishes the session, then stops the client's threads whatever the server answered
            with contextlib.suppress(Exception):
                client.close("success").result(timeout=30)
        server.stop()


def service_client(server: Server, tenant: str = "alice"):
    """The real tinker SDK's ServiceClient pointed at the server (closed when a running_server block ends)."""
    import tinker

    client = tinker.ServiceClient(base_url=server.url, api_key=KEYS[tenant])
    _clients.setdefault(id(server), []).append(client)
    return client


def rest_client(server: Server, tenant: str = "alice"):
    """The real tinker SDK's RestClient pointed at the server."""
    import tinker

    return tinker.RestClient(base_url=server.url, api_key=KEYS[tenant])


def served_tiny_base(directory: Path) -> Path:
    """The seed-0 tiny base `dsv4flash serve --base random-tiny` (the tests' servers) holds, as a base directory
    transformers loads."""
    from dsv4flash.config import load_config
    from dsv4flash.engine import model_io
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks import TaskTokenizer

    cfg = load_config("tiny")
    return model_io.save_base(Transformer(cfg, seed=0), cfg, TaskTokenizer(cfg), directory, {"source": "test"})


def peft_prompt_logprobs(base_dir: Path, adapter_dir: Path, tokens: list[int]) -> list[float]:
    """log p(tokens[i] | tokens[:i]), i >= 1, of the adapter loaded as docs/lora.md says (transformers + PEFT)."""
    # Fails on any PEFT warning of missing or unexpected adapter keys: PEFT only warns about them.
    import warnings

    import peft
    import torch
    from transformers import AutoModelForCausalLM

    import dsv4flash  # noqa: F401  (registers DeepseekV41ForCausalLM with the auto classes)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    bad = [str(w.message) for w in caught if "missing" in str(w.message) or "unexpected" in str(w.message)]
    assert not bad, bad
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), -1)
    return [float(logp[i - 1, t]) for i, t in enumerate(tokens) if i > 0]


def rl_batch(types, sampled, prompt: list[int]):
    """Cookbook RL data of `types` (the SDK's or the core's): reward = share of even tokens, A = r - group mean,
    targets = the sampled tokens; -> (data, mean reward)."""
    rewards = np.array([np.mean([t % 2 == 0 for t in s.tokens]) for s in sampled])
    adv = rewards - rewards.mean()
    data = []
    for s, a in zip(sampled, adv):
        tokens = prompt + list(s.tokens)
        n_prompt = len(prompt) - 1
        logprobs = np.array([0.0] * n_prompt + list(s.logprobs), dtype=np.float32)
        advantages = np.array([0.0] * n_prompt + [a] * len(s.tokens), dtype=np.float32)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs=dict(target_tokens=np.array(tokens[1:], dtype=np.int64),
                                                    logprobs=logprobs, advantages=advantages)))
    return data, float(rewards.mean())
