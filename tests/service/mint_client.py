"""Run by test_http_mint.py in a child process whose path puts mindlab-toolkit 0.2.0 (and its tinker 0.22.0)
first: `import mint` with MINT_BASE_URL / MINT_API_KEY, a short training loop, then MinT's two extension calls.
Prints one JSON object with what the test checks."""

import io
import json
import os
import sys
import tarfile
import urllib.request

import numpy as np
import tinker  # noqa: E402  (0.22.0, before MinT patches it)


def _jwt(key: str) -> str:
    """A JWT for `key`'s tenant from the server's key -> JWT exchange."""
    request = urllib.request.Request(f"{os.environ['MINT_BASE_URL']}/api/v1/auth/token", data=b"{}", method="POST",
                                     headers={"X-API-Key": key, "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["jwt"]


def _owners(client) -> list[str]:
    """The owners of the runs a client's key lists (accepted: its own tenant's, possibly none)."""
    return sorted({r.model_owner for r in client.create_rest_client().list_training_runs().result().training_runs})


out = {}
jwt = _jwt(os.environ["MINT_API_KEY"])  # mallory's, minted with her sk- key
# plain tinker 0.22, each key form as api_key: the SDK's own prefix check takes tml- and eyJ (JWT) and refuses sk-
for form, key in (("tml", os.environ["DSV4FLASH_TML_KEY"]), ("jwt", jwt), ("sk", os.environ["MINT_API_KEY"])):
    try:
        out[f"plain_{form}"] = _owners(tinker.ServiceClient(base_url=os.environ["MINT_BASE_URL"], api_key=key))
    except Exception as exc:  # noqa: BLE001  (the test reads the message)
        out[f"plain_{form}"] = f"{type(exc).__name__}: {exc}"

import mint  # noqa: E402  (applies MinT's patches: sk- keys, MINT_* environment)
from mint import types  # noqa: E402

out.update({"mint": mint.__version__, "tinker": mint.__tinker_version__})
# a tml- key through MinT's client too (its patch hands anything but sk- to tinker's own check)
tml = mint.ServiceClient(api_key=os.environ["DSV4FLASH_TML_KEY"])
out["mint_tml_runs"] = len(tml.create_rest_client().list_training_runs().result().training_runs)
sc = mint.ServiceClient()
tc = sc.create_lora_training_client(base_model="tiny", rank=4)
if hasattr(tc, "result"):
    tc = tc.result()
out["model_id"] = tc.model_id
tokens = [0, 10, 11, 12, 20, 21, 22, 1]
datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(7, np.float32)})
losses = []
for _ in range(2):
    fb = tc.forward_backward([datum], "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
    losses.append(fb.result().metrics["loss:sum"])
    opt.result()
out["losses"] = losses
out["forward_logprobs"] = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
a = tc.save_weights_for_sampler("a").result().path
fb, opt = tc.forward_backward([datum], "cross_entropy"), tc.optim_step(types.AdamParams(learning_rate=1e-2))
fb.result(), opt.result()
b = tc.save_weights_for_sampler("b").result().path
out["a"], out["b"] = a, b
sampler = sc.create_sampling_client(model_path=a)
if hasattr(sampler, "result"):
    sampler = sampler.result()
seq = sampler.sample(types.ModelInput.from_ints([0, 10, 11]), 2, types.SamplingParams(max_tokens=3, seed=5)).result()
out["sampled"] = [list(s.tokens) for s in seq.sequences]
out["a_logprobs"] = sampler.compute_logprobs(types.ModelInput.from_ints(tokens[:-1])).result()[1:]

# getting weights out, SDK 0.22's way: a signed URL of a tar of the checkpoint's PEFT adapter
archive = sc.create_rest_client().get_checkpoint_archive_url_from_tinker_path(a).result()
out["archive_url"] = archive.url
with urllib.request.urlopen(archive.url, timeout=60) as response:
    with tarfile.open(fileobj=io.BytesIO(response.read())) as tar:
        out["archive_members"] = tar.getnames()
        tar.extractall(os.environ["DSV4FLASH_DOWNLOAD_DIR"], filter="data")

mixed = mint.mint.interpolate_checkpoints(sc, source_paths=[a, b], coefficients=[0.25, 0.75], output_path="mix")
out["interpolated"] = mixed.model_dump()
kl = mint.mint.forward_backward_reverse_kl(tc, reference_model_path=a, temperature=1.0, data=[mint.mint.ReverseKLDatum(
    student_input=types.ModelInput.from_ints(tokens[:-1]), reference_input=types.ModelInput.from_ints(tokens[:-1]),
    target_tokens={"data": tokens[1:], "dtype": "int64"}, weights={"data": [1.0] * 7})])
out["reverse_kl"] = kl.model_dump()
out["mint_jwt_owners"] = _owners(mint.ServiceClient(api_key=jwt))  # a JWT through MinT's client: mallory's runs
json.dump(out, sys.stdout)
