"""`MegatronTrainingClient`: the Tinker training surface of `TrainingClient`, computed by the Megatron trainer group.

Everything a client sees stays `TrainingClient`'s (request checks, call order and futures, scheduler turns,
checkpoint publishing, loss reporting): only the trainer backend's hooks are replaced. Losses and log-probs are
reported exactly as the local trainer reports them (the built-in losses of the returned log-probs, on the CPU);
the gradients come from the same losses run by the workers on the live log-probs (`batch.batch_loss`). A custom
loss (a Python callable, or a server-side graph) runs here on the log-probs of a forward pass and its gradient
w.r.t. them goes back as a linear surrogate (Tinker's own two-pass design): Σ g·log p has the same gradient.
Checkpoints hold canonical tensors and a `torch.optim.AdamW` state dict over them, as the local trainer writes,
so a run saved by either trainer resumes on the other.
"""

from __future__ import annotations

import torch

from dsv4flash.service import calls
from dsv4flash.service.compute.megatron.batch import build_batch, row_logprobs
from dsv4flash.service.compute.training import NonFiniteError, TrainingClient, _tinker_types, call_custom_loss
from dsv4flash.service.types import check_adam_params


class MegatronTrainingClient(TrainingClient):
    """One LoRA run whose adapter, moments and step live in a slot of the trainer group."""

    resource = "trainer"

    def __init__(self, service, run_id: str, placement, group, fresh: dict[str, torch.Tensor]) -> None:
        super().__init__(service, run_id, placement, None)
        self.group = group
        self.order = list(fresh)  # canonical keys in the local trainer's parameter order (its optimizer's indices)
        self.shapes = {k: tuple(v.shape) for k, v in fresh.items()}
        self.scale = float(placement.alpha) / int(placement.rank)
        self.hyper: dict | None = None  # lr, betas, eps, weight_decay of the last step (a checkpoint's param group)
        group.admit(self.shapes, int(placement.rank), service.fingerprint())
        group.create(run_id, {k: v.detach() for k, v in fresh.items()}, self.scale, project=True)

    def release(self) -> None:
        """Free the run's slot on the trainer group once its queued calls are done."""
        self._exec.submit(self.group.drop, self.run_id)

    @property
    def adapter(self) -> dict[str, torch.Tensor]:
        """The adapter's canonical tensors as last acknowledged (copies)."""
        return self.group.state(self.run_id, self.shapes)["value"]

    @adapter.setter
    def adapter(self, value) -> None:
        if value is not None:
            raise AttributeError("a Megatron run's adapter lives in its trainer slot; load_state replaces it")

    def adapter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical adapter key -> shape of this run's placement."""
        return dict(self.shapes)

    # ---- compute hooks (see TrainingClient) ----
    def _run_loss(self, data, loss_fn, loss_fn_config, provenance, backward: bool):
        batch, _ = build_batch(data, loss_fn, loss_fn_config, provenance, self.group.dp,
                               self.service.base.cfg.pad_token_id, micro_batch=self.group.plane.micro_batch)
        out = (self.group.backward if backward else self.group.forward)(self.run_id, batch)
        try:
            logps = row_logprobs(out, data)
            per, total = self._losses(logps, data, loss_fn, loss_fn_config, provenance, backward)
        except BaseException:
            if backward:  # the workers' gradients of this call are live but not acknowledged: drop them
                self.group.rollback(self.run_id)
            raise
        return logps, per, total

    def _run_custom(self, data, loss_fn):
        batch, _ = build_batch(data, "cross_entropy", None, [None] * len(data), self.group.dp,
                               self.service.base.cfg.pad_token_id,
                               inputs=[{"weights": torch.zeros(d.model_input.length)} for d in data],
                               micro_batch=self.group.plane.micro_batch)
        logps = [lp.requires_grad_() for lp in row_logprobs(self.group.forward(self.run_id, batch), data)]
        loss, metrics = call_custom_loss(loss_fn, data, logps)
        if not torch.isfinite(loss):
            raise NonFiniteError(f"forward_backward_custom: the loss is {float(loss.detach())}; refused, gradients "
                                 f"and adapter unchanged")
        grads = torch.autograd.grad(loss.reshape(()), logps, allow_unused=True)
        # cross_entropy's loss is −Σ w·log p, so weights −g make its gradient Σ g·∇log p, the custom loss's
        weights = [{"weights": -(g if g is not None else torch.zeros_like(lp)).detach()} for g, lp in zip(grads, logps)]
        surrogate, _ = build_batch(data, "cross_entropy", None, [None] * len(data), self.group.dp,
                                   self.service.base.cfg.pad_token_id, inputs=weights,
                                   micro_batch=self.group.plane.micro_batch)
        self.group.backward(self.run_id, surrogate)
        self._keep_gradients(loss.detach(), "forward_backward_custom")
        return [lp.detach() for lp in logps], loss, metrics

    def _keep_gradients(self, total: torch.Tensor, what: str) -> None:
        """Keep the gradients the workers just accumulated, or undo them (a non-finite loss, a stopped call)."""
        try:
            calls.check()  # the last point where stopping the call leaves the run unchanged
            if not torch.isfinite(total):
                raise NonFiniteError(f"{what}: the loss is {float(total.detach())}; refused, gradients and adapter "
                                     f"unchanged")
            self.group.commit_grads(self.run_id)
        except FloatingPointError as exc:
            raise NonFiniteError(str(exc)) from None
        except BaseException:
            self.group.rollback(self.run_id)
            raise

    def _optim_step(self, hp):
        check_adam_params(hp)
        try:
            metrics = self.group.optim_step(self.run_id, hp.learning_rate, (hp.beta1, hp.beta2), hp.eps,
                                            hp.weight_decay, hp.grad_clip_norm if hp.grad_clip_norm > 0 else 0.0)
        except FloatingPointError as exc:
            raise NonFiniteError(str(exc)) from None
        self.hyper = {"lr": hp.learning_rate, "betas": (hp.beta1, hp.beta2), "eps": hp.eps,
                      "weight_decay": hp.weight_decay}
        self.step += 1
        return _tinker_types().OptimStepResponse(metrics={"step": float(self.step),
                                                          **({"grad_norm": metrics["grad_norm"]}
                                                             if hp.grad_clip_norm > 0 and "grad_norm" in metrics
                                                             else {})})

    def _trainer_state(self, with_optimizer: bool):
        state = self.group.state(self.run_id, self.shapes)
        if not with_optimizer or state["exp_avg"] is None:
            return state["value"], None
        return state["value"], self._adamw_state_dict(state)

    def _apply_state(self, tensors, optimizer, step) -> None:
        moments = None
        if optimizer is not None:
            moments = self._moments_of(optimizer)
            self.hyper = {k: optimizer["param_groups"][0][k] for k in ("lr", "betas", "eps", "weight_decay")}
        self.group.load(self.run_id, {k: tensors[k] for k in self.order}, moments, step if step is not None else 0,
                        self.scale)
        if optimizer is not None:
            self.step = step

    # ---- the local trainer's optimizer format ----
    def _adamw(self, hyper: dict | None = None) -> torch.optim.AdamW:
        params = [torch.nn.Parameter(torch.zeros(self.shapes[k])) for k in self.order]
        opt = torch.optim.AdamW(params)
        if hyper is not None:
            opt.param_groups[0].update(hyper)
        return opt

    def _adamw_state_dict(self, state: dict) -> dict:
        """The moments as `torch.optim.AdamW.state_dict()` over the adapter in the local trainer's order."""
        opt = self._adamw(self.hyper)
        for i, key in enumerate(self.order):
            opt.state[opt.param_groups[0]["params"][i]] = {
                "step": torch.tensor(float(state["step"])), "exp_avg": state["exp_avg"][key],
                "exp_avg_sq": state["exp_avg_sq"][key]}
        return opt.state_dict()

    def _moments_of(self, optimizer: dict) -> tuple[dict, dict]:
        """(exp_avg, exp_avg_sq) canonical dicts of an AdamW state dict over this placement's adapter."""
        opt = self._adamw()
        opt.load_state_dict(optimizer)
        params = opt.param_groups[0]["params"]
        missing = [k for k, p in zip(self.order, params) if "exp_avg" not in opt.state.get(p, {})]
        if missing:
            raise ValueError(f"optimizer state: no Adam moments for adapter tensor {missing[0]}")
        return ({k: opt.state[p]["exp_avg"] for k, p in zip(self.order, params)},
                {k: opt.state[p]["exp_avg_sq"] for k, p in zip(self.order, params)})
