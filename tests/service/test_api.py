"""Futures order, losses, save/load state (with optimizer) and checkpoint paths."""

import threading

import pytest
import torch

import dsv4flash.service as tinker
from dsv4flash.service import types


def _datum(tokens, **extra):
    inputs = dict(target_tokens=tokens[1:], weights=[1.0] * (len(tokens) - 1))
    inputs.update(extra)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


@pytest.fixture
def service(resident, tmp_path):
    return tinker.ServiceClient(root=tmp_path, resident=resident)


def test_futures_resolve_in_submission_order(service):
    tc = service.create_lora_training_client(rank=2, preset="decoder_half")
    done = []
    data = [_datum([0, 5, 6, 7, 8])]
    futs = []
    for i in range(3):
        futs.append(tc.forward_backward(data, "cross_entropy"))
        futs.append(tc.optim_step(types.AdamParams(learning_rate=1e-2)))
    watchers = [threading.Thread(target=lambda i=i, f=f: (f.result(), done.append(i))) for i, f in enumerate(futs)]
    for w in reversed(watchers):
        w.start()
    for w in watchers:
        w.join()
    assert [f.result().metrics["step"] for f in futs[1::2]] == [1.0, 2.0, 3.0]
    losses = [f.result().metrics["loss:sum"] for f in futs[0::2]]
    assert losses[0] > losses[1] > losses[2]  # each forward saw the previous step's weights
    assert len(set(f.request_id for f in futs)) == 6


def test_losses_match_definitions(service):
    tc = service.create_lora_training_client(rank=2, preset="decoder_half", seed=1)
    toks = [0, 5, 6, 7, 8, 9]
    lp = tc.forward([_datum(toks)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    old = lp - 0.5
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0])
    for fn, expect in [("importance_sampling", -(torch.exp(lp - old) * adv).sum()),
                       ("ppo", -torch.minimum(torch.exp(lp - old) * adv,
                                               torch.exp(lp - old).clamp(0.8, 1.2) * adv).sum()),
                       ("cispo", -(torch.exp(lp - old).clamp(0.0, 4.0) * adv * lp).sum()),
                       ("dro", -(lp * adv - 0.025 * (lp - old) ** 2).sum())]:
        out = tc.forward([_datum(toks, logprobs=old, advantages=adv)], fn).result()
        assert out.metrics["loss:sum"] == pytest.approx(float(expect), rel=1e-5)
    with pytest.raises(KeyError, match="advantages"):
        tc.forward([_datum(toks, logprobs=old)], "ppo").result()
    with pytest.raises(ValueError, match="loss_fn must be one of"):
        tc.forward([_datum(toks)], "nope").result()


def _grads(tc):
    return {k: p.grad.clone() for k, p in tc.adapter.items() if p.grad is not None}


def test_cispo_keeps_gradient_where_ppo_clips_it_and_dro_beta_is_configurable(service):
    """Token ratio far outside the clip band: PPO's clipped branch has no gradient, CISPO's weight still does."""
    toks = [0, 5, 6, 7]
    out = {}
    for fn in ("ppo", "cispo"):
        tc = service.create_lora_training_client(rank=2, preset="decoder_half", seed=3)
        tc.optim_step(types.AdamParams(learning_rate=1e-2))  # B != 0 from here on, so A gets gradients too
        lp = tc.forward([_datum(toks)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
        tc.forward_backward([_datum(toks, logprobs=lp - 3.0, advantages=[1.0, 1.0, 1.0])], fn).result()
        out[fn] = _grads(tc)
    assert all(float(g.abs().max()) == 0.0 for g in out["ppo"].values())  # ratio e^3 > 1.2 with A > 0: clipped
    assert any(float(g.abs().max()) > 0.0 for g in out["cispo"].values())
    tc = service.create_lora_training_client(rank=2, preset="decoder_half", seed=3)
    lp = tc.forward([_datum(toks)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    d = _datum(toks, logprobs=lp - 1.0, advantages=[0.0, 0.0, 0.0])
    assert tc.forward([d], "dro", {"beta": 2.0}).result().metrics["loss:sum"] == pytest.approx(3.0, rel=1e-5)


def test_forward_backward_custom_matches_builtin_and_runs_a_pairwise_loss(service):
    """A custom loss equal to cross_entropy gives bit-equal gradients; a Bradley-Terry (DPO-style) loss trains."""
    data = [_datum([0, 5, 6, 7, 8]), _datum([0, 9, 10, 11])]
    builtin = service.create_lora_training_client(rank=2, preset="decoder_half", seed=4)
    custom = service.create_lora_training_client(rank=2, preset="decoder_half", seed=4)
    for tc in (builtin, custom):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    builtin.forward_backward(data, "cross_entropy").result()

    def ce(batch, logprobs):
        per = [-(lp * d.loss_fn_inputs["weights"].to_torch().to(lp.dtype)).sum() for lp, d in zip(logprobs, batch)]
        total = torch.stack(per).sum()
        return total, {"ce": float(total.detach())}

    res = custom.forward_backward_custom(data, ce).result()
    assert res.loss_fn_output_type == "custom" and res.metrics["ce"] == res.metrics["loss:sum"]
    g1, g2 = _grads(builtin), _grads(custom)
    assert g1.keys() == g2.keys() and all(torch.equal(g1[k], g2[k]) for k in g1)

    def bradley_terry(batch, logprobs):  # chosen = datum 0, rejected = datum 1 (the cookbook's DPO shape)
        margin = logprobs[0].sum() - logprobs[1].sum()
        loss = -torch.nn.functional.logsigmoid(margin)
        return loss, {"margin": float(margin.detach())}

    pref = service.create_lora_training_client(rank=2, preset="decoder_half", seed=5)
    margins = []
    for _ in range(3):
        margins.append(pref.forward_backward_custom(data, bradley_terry).result().metrics["margin"])
        pref.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    assert margins[0] < margins[1] < margins[2]
    with pytest.raises(TypeError, match="must be callable"):
        pref.forward_backward_custom(data, "cross_entropy")
    with pytest.raises(TypeError, match=r"return \(loss, metrics\)"):
        pref.forward_backward_custom(data, lambda b, lps: lps[0].sum()).result()
    with pytest.raises(ValueError, match="scalar tensor"):
        pref.forward_backward_custom(data, lambda b, lps: (torch.tensor(1.0), {})).result()


@pytest.mark.parametrize("store", ["dir", "s3"])
def test_save_load_state_with_optimizer_resumes_bit_identically(store, resident, tmp_path, request):
    """Also on an s3:// store, where a second server (another machine's: its own state directory) resumes the run."""
    from dsv4flash.lifecycle.store import AdapterStore

    root = tmp_path / "store"
    if store == "s3":
        root = request.getfixturevalue("s3_url")
        AdapterStore.open(root, tmp_path / "catalog.sqlite", create=True).close()
    service = tinker.ServiceClient(root=root, resident=resident, state_dir=tmp_path / "state")
    data = [_datum([0, 5, 6, 7, 8]), _datum([0, 9, 10, 11])]
    hp = types.AdamParams(learning_rate=1e-2)

    def steps(tc, n):
        for _ in range(n):
            tc.forward_backward(data, "cross_entropy")
            tc.optim_step(hp)
        return {k: p.detach().clone() for k, p in tc._exec.submit(lambda: tc.adapter).result().items()}

    a = service.create_lora_training_client(rank=2, preset="decoder_half", seed=5)
    steps(a, 2)
    path = a.save_state("mid").result().path
    assert path == f"tinker://{a.run_id}/weights/mid"
    assert a.save_state("mid").result().path == path  # save-by-name is idempotent
    final_a = steps(a, 2)

    b = service.create_lora_training_client(rank=2, preset="decoder_half", seed=99)
    b.load_state_with_optimizer(path.replace("tinker://", "mint://")).result()
    final_b = steps(b, 2)
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)

    c = service.create_lora_training_client(rank=2, preset="decoder_half", seed=99)
    c.load_state(path).result()  # weights only: fresh moments -> a different trajectory
    final_c = steps(c, 2)
    assert not all(torch.equal(final_a[k], final_c[k]) for k in final_a)

    other = tinker.ServiceClient(root=root, resident=resident, state_dir=tmp_path / "other-state")
    d = other.create_training_client_from_state_with_optimizer(path)
    assert all(torch.equal(final_a[k], v) for k, v in steps(d, 2).items())
    assert any(b.size > 0 for b in other.store.blobs.iter_blobs())


def test_bad_paths_and_inputs(service):
    tc = service.create_lora_training_client(rank=2, preset="decoder_half")
    with pytest.raises(ValueError, match="expected tinker://"):
        tc.load_state("s3://x/y").result()
    with pytest.raises(FileNotFoundError, match="not in the store"):
        tc.load_state(f"tinker://{tc.run_id}/weights/missing").result()
    sp = tc.save_weights_for_sampler("s").result().path
    with pytest.raises(ValueError, match="no optimizer state"):
        tc.load_state_with_optimizer(sp).result()
    bad = types.Datum(model_input=types.ModelInput.from_ints([0, 1, 2]), loss_fn_inputs={"target_tokens": [1, 2],
                                                                                          "weights": [1, 1]})
    with pytest.raises(ValueError, match=r"datum 0: loss_fn_inputs\['target_tokens'\] has shape \[2\], expected \[3\]"):
        tc.forward([bad], "cross_entropy").result()
    with pytest.raises(ValueError, match="resident base"):
        service.create_lora_training_client(base_model="flash")


def test_adapters_share_one_base(service):
    a = service.create_lora_training_client(rank=2, preset="decoder_half")
    b = service.create_lora_training_client(rank=4, preset="full_linear")
    base_ptrs = {n: p.data_ptr() for n, p in service.base.model.named_parameters()}
    assert len(service.base._shells) >= 2
    for shell in service.base._shells.values():
        shared = {n.replace(".base.", "."): p.data_ptr() for n, p in shell.named_parameters()
                  if not n.endswith((".lora_A", ".lora_B"))}
        assert shared == base_ptrs  # every base tensor is the resident one (held once)
    assert all(a.adapter[k].data_ptr() != b.adapter[k].data_ptr() for k in set(a.adapter) & set(b.adapter))
    s = a.save_weights_and_get_sampling_client()
    r = s.sample(types.ModelInput.from_ints([0, 5, 6]), 2, types.SamplingParams(max_tokens=2, seed=1)).result()
    assert len(r.sequences) == 2 and all(len(q.tokens) == len(q.logprobs) for q in r.sequences)


def test_async_twins_double_await(service):
    import asyncio

    tc = service.create_lora_training_client(rank=2, preset="decoder_half")

    async def main():
        fb = await tc.forward_backward_async([_datum([0, 5, 6, 7])], "cross_entropy")
        opt = await tc.optim_step_async(types.AdamParams())
        return await fb, await opt

    out, step = asyncio.run(main())
    assert out.metrics["loss:sum"] > 0 and step.metrics["step"] == 1.0


def test_early_stopped_backward_matches_full_gradient(service):
    from dsv4flash.service.compute.training import target_logprobs

    tc = service.create_lora_training_client(rank=2, preset="decoder_half", seed=2)
    data = [_datum([0, 5, 6, 7, 8])]
    with service.base.bind(tc.placement, tc.adapter) as model:
        torch.manual_seed(0)
        with torch.no_grad():
            for k, p in tc.adapter.items():
                p.add_(torch.randn_like(p) * 0.01)
        lp_es = target_logprobs(model, data)[0]
        with torch.no_grad():
            full = model(torch.tensor([data[0].model_input.to_ints()]))
        lp_full = torch.log_softmax(full, -1)[0].gather(-1, data[0].loss_fn_inputs["target_tokens"].to_torch()[:, None])
    assert torch.equal(lp_es.detach(), lp_full.squeeze(-1))


def _content(resp):
    """What a sample answered, without the per-call sequence ids (names, not content)."""
    return resp.prompt_logprobs, [(s.stop_reason, s.tokens, s.logprobs, s.topk_logprobs) for s in resp.sequences]


def test_sampling_params_and_stop_reasons(service):
    from dsv4flash.engine.sampling import process_logits

    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    top1 = process_logits(logits, types.SamplingParams(top_k=1))
    assert torch.isfinite(top1).sum() == 1 and top1[0, 3] == 0.0
    topp = process_logits(logits, types.SamplingParams(top_p=0.7))  # softmax ≈ .03 .09 .24 .64
    assert torch.isfinite(topp).tolist() == [[False, False, True, True]]
    sc = service.create_sampling_client()
    prompt = types.ModelInput.from_ints([0, 5, 6])
    greedy = sc.sample(prompt, 2, types.SamplingParams(max_tokens=3, temperature=0.0)).result()
    assert greedy.sequences[0].tokens == greedy.sequences[1].tokens and greedy.sequences[0].stop_reason == "length"
    first = greedy.sequences[0].tokens[0]
    stopped = sc.sample(prompt, 1, types.SamplingParams(max_tokens=3, temperature=0.0, stop=[first])).result()
    assert stopped.sequences[0].tokens == [first] and stopped.sequences[0].stop_reason == "stop"
    again = sc.sample(prompt, 2, types.SamplingParams(max_tokens=3, seed=7)).result()
    assert _content(again) == _content(sc.sample(prompt, 2, types.SamplingParams(max_tokens=3, seed=7)).result())


def test_cached_sample_equals_full_recompute(service):
    # `sample` prefills once and decodes with the CSA2 cache; use_cache=False recomputes every step. With the
    # release's fake-quant points on, both draw the same tokens; their log-probs are compared with the points off
    # (dsv4flash/model/quant.py `fake_quant`): the two orders of summation differ by ulps, and at an E2M1/E4M3
    # code boundary an ulp moves a quantized KV lane by a whole code, which no tolerance of a correct cache bounds.
    from dsv4flash.model.quant import fake_quant

    tc = service.create_lora_training_client(rank=2, preset="full_linear", seed=3)
    tc.forward_backward([_datum([0, 5, 6, 7, 8, 9])], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=5e-2))
    for sc in (tc.save_weights_and_get_sampling_client(), service.create_sampling_client()):
        for quantized in (True, False):
            with fake_quant(quantized):
                prompt = types.ModelInput.from_ints([0, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20])  # past the window
                probe = sc.sample(prompt, 4, types.SamplingParams(max_tokens=12, temperature=1.0, seed=5)).result()
                params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=5,
                                              stop=[probe.sequences[0].tokens[3]])
                cached = sc.sample(prompt, 4, params).result()
                assert {s.stop_reason for s in cached.sequences} == {"stop", "length"}  # rows leave the batch early
                sc.use_cache = False
                full = sc.sample(prompt, 4, params).result()
                sc.use_cache = True
            assert [s.tokens for s in cached.sequences] == [s.tokens for s in full.sequences]
            assert [s.stop_reason for s in cached.sequences] == [s.stop_reason for s in full.sequences]
            assert len({tuple(s.tokens) for s in cached.sequences}) > 1
            if not quantized:
                for a, b in zip(cached.sequences, full.sequences):
                    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_rank_is_the_preset_s_unless_given_and_a_fixed_rank_refuses_another(service):
    """No rank: the preset's (full_linear_r8 fixes 8, full_linear takes any, 16 unset); an explicit rank wins."""
    assert service.create_lora_training_client(preset="full_linear_r8").placement.rank == 8
    assert service.create_lora_training_client(preset="full_linear_r8", rank=8).placement.rank == 8
    assert service.create_lora_training_client().placement.rank == 16
    tc = service.create_lora_training_client(rank=4)
    assert tc.placement.rank == 4 and tc.adapter["layers.0.attn.wq_a.lora_A.weight"].shape[0] == 4
    info = tc.get_info()  # tinker.types.GetInfoResponse, as the SDK's TrainingClient answers
    assert (info.lora_rank, info.is_lora, info.model_id, info.model_data.model_name) == (4, True, tc.run_id, "tiny")
    with pytest.raises(ValueError, match=r"^LoraConfig.rank: 32 conflicts with preset 'full_linear_r8', which fixes "
                                         r"rank 8"):
        service.create_lora_training_client(rank=32, preset="full_linear_r8")


def test_train_unembed_trains_a_head_lora_that_survives_resume_and_export(service):
    """train_unembed (Tinker's default) adapts the output head: it trains, a resumed run keeps it, the PEFT export
    targets `head` (test_http_protocol loads such an export in PEFT); train_unembed=False leaves it out."""
    import json

    off = service.create_lora_training_client(rank=2, preset="decoder_half", train_unembed=False)
    assert not off.placement.train_head and not [k for k in off.adapter if k.startswith("head.")]
    tc = service.create_lora_training_client(rank=2, preset="decoder_half", seed=3)
    assert tc.placement.train_head and tc.adapter["head.lora_B.weight"].abs().max() == 0
    tc.forward_backward([_datum([0, 5, 6, 7, 8])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert tc.adapter["head.lora_B.weight"].abs().max() > 0
    state = tc.save_state("s").result().path
    resumed = service.create_training_client_from_state(state)
    assert resumed.placement.train_head and torch.equal(resumed.adapter["head.lora_B.weight"],
                                                        tc.adapter["head.lora_B.weight"])
    adapter_dir, _ = service.peft_archive(state)
    assert "head" in json.loads((adapter_dir / "adapter_config.json").read_text())["target_modules"].split("|")
    with pytest.raises(ValueError, match="pass train_unembed"):
        service.create_lora_training_client(rank=2, train_head=True)
