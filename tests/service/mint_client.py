"""Run by test_http_mint.py in a child process whose path puts mindlab-toolkit 0.2.0 (and its tinker 0.22.0)
first: `import mint` with MINT_BASE_URL / MINT_API_KEY, a short training loop, then MinT's two extension calls.
Prints one JSON object with what the test checks."""

import json
import sys

import numpy as np

import mint  # noqa: E402  (applies MinT's patches: sk- keys, MINT_* environment)
from mint import types  # noqa: E402

out = {"mint": mint.__version__, "tinker": mint.__tinker_version__}
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

mixed = mint.mint.interpolate_checkpoints(sc, source_paths=[a, b], coefficients=[0.25, 0.75], output_path="mix")
out["interpolated"] = mixed.model_dump()
kl = mint.mint.forward_backward_reverse_kl(tc, reference_model_path=a, temperature=1.0, data=[mint.mint.ReverseKLDatum(
    student_input=types.ModelInput.from_ints(tokens[:-1]), reference_input=types.ModelInput.from_ints(tokens[:-1]),
    target_tokens={"data": tokens[1:], "dtype": "int64"}, weights={"data": [1.0] * 7})])
out["reverse_kl"] = kl.model_dump()
json.dump(out, sys.stdout)
