"""`TrainingClient`: forward / forward_backward / optim_step / save & load state over the resident base."""

from __future__ import annotations

import contextlib
import copy
import io
from typing import Any

import torch
import torch.nn.functional as F

from dsv4flash.service import calls
from dsv4flash.service.compute import losses
from dsv4flash.service.compute.stability import LOCAL_OWNER
from dsv4flash.service.plane.checkpoints import check_ttl
from dsv4flash.service.futures import APIFuture, OrderedExecutor
from dsv4flash.service.types import (AdamParams, Datum, ForwardBackwardOutput, ParsedCheckpointTinkerPath, TensorData,
                                     check_adam_params)


def _tinker_types():
    """`tinker.types`, imported on first use: the responses are the SDK's own, and importing the service (as the
    veRL rollout backend does for its sampling) must not need the SDK."""
    from tinker import types

    return types


class NonFiniteError(ValueError):
    """A loss, gradient or update that is NaN or infinite; the call is refused and the adapter left as it was."""


def target_logprobs(model, data: list[Datum]) -> list[torch.Tensor]:
    """log p(target_tokens[t] | model_input[:t+1]) per datum, batched with right padding (causal: no effect)."""
    rows = [d.model_input.to_ints() for d in data]
    targets = [d.loss_fn_inputs["target_tokens"].to_torch().long().reshape(-1) for d in data]
    for i, (r, t) in enumerate(zip(rows, targets)):
        if len(r) != t.numel() or not r:
            raise ValueError(f"datum {i}: model_input has {len(r)} tokens but target_tokens has {t.numel()} "
                             f"(they must be equal and non-empty)")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), model.cfg.pad_token_id, dtype=torch.long)
    tgt = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, t) in enumerate(zip(rows, targets)):
        ids[i, : len(r)], tgt[i, : len(r)] = torch.tensor(r), t
    from dsv4flash.lora import forward_with_early_stop

    device = model.head.weight.device  # where the resident base computes (dsv4flash/engine/device.py)
    if device.type != "cpu":
        ids, tgt = ids.to(device), tgt.to(device)
    # Frozen prefix (e.g. decoder_half's encoder) runs without autograd; same logits as model(ids).
    logits = forward_with_early_stop(model, ids) if torch.is_grad_enabled() else model(ids)  # [B,W,V] fp32
    logp = F.log_softmax(logits, dim=-1).gather(-1, tgt[..., None]).squeeze(-1)  # [B,W]
    if device.type != "cpu":
        logp = logp.cpu()  # the losses' inputs came with the request: on the CPU (autograd flows back through)
    return [logp[i, : len(r)] for i, r in enumerate(rows)]


def datum_losses(loss_fn: str, loss_fn_config: dict | None, logps: list[torch.Tensor], data: list[Datum],
                 provenance: list) -> list[torch.Tensor]:
    """One built-in loss per datum from its target log-probs (the one place a request's inputs meet the losses)."""
    return [losses.datum_loss(loss_fn, lp, {k: v.to_torch() for k, v in d.loss_fn_inputs.items()}, loss_fn_config,
                              prov) for lp, d, prov in zip(logps, data, provenance)]


def call_custom_loss(loss_fn, data: list[Datum], logps: list[torch.Tensor]):
    """`loss_fn(data, logps)` -> (scalar loss with a gradient, metrics); TypeError/ValueError on a bad return."""
    returned = loss_fn(data, logps)
    if not (isinstance(returned, tuple) and len(returned) == 2):
        raise TypeError("forward_backward_custom: loss_fn must return (loss, metrics)")
    loss, metrics = returned
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
        raise ValueError("forward_backward_custom: the loss must be a scalar tensor computed from the logprobs")
    return loss, metrics


class TrainingClient:
    """One LoRA training run on the resident base; every call returns an `APIFuture`, run in submission order."""

    resource = "base"  # what its compute occupies: the server's scheduler for it grants the turns

    def __init__(self, service, run_id: str, placement, adapter: dict[str, torch.nn.Parameter]) -> None:
        self.service, self.run_id, self.placement = service, run_id, placement
        self.adapter = adapter
        self.optimizer: torch.optim.AdamW | None = None
        self.step = 0
        self._exec = OrderedExecutor(run_id)

    # ---- Tinker surface ----
    def forward(self, data: list[Datum], loss_fn: str, loss_fn_config: dict | None = None, *,
                owner: str = LOCAL_OWNER) -> APIFuture:
        """Loss and target log-probs without gradients (`owner`: whose recorded sequences provenance names)."""
        return self._exec.submit(self._forward_backward, list(data), loss_fn, loss_fn_config, False, owner)

    def forward_backward(self, data: list[Datum], loss_fn: str, loss_fn_config: dict | None = None, *,
                         owner: str = LOCAL_OWNER) -> APIFuture:
        """Loss, target log-probs, and gradients accumulated until the next `optim_step`."""
        return self._exec.submit(self._forward_backward, list(data), loss_fn, loss_fn_config, True, owner)

    def check_request(self, data: list[Datum], loss_fn: str, loss_fn_config: dict | None,
                      owner: str = LOCAL_OWNER) -> list:
        """Raise naming the datum/field/option when a built-in-loss request is malformed -> each datum's
        resolved provenance (None where it has none)."""
        if not data:
            raise ValueError("forward_backward: empty data list")
        losses.check_config(loss_fn, loss_fn_config)
        self.check_context(data)
        vocab = self.service.base.cfg.text.vocab_size
        for i, d in enumerate(data):
            losses.check_inputs(loss_fn, i, d.loss_fn_inputs)
            taken = losses.LOSS_INPUTS[loss_fn] + losses.OPTIONAL_INPUTS.get(loss_fn, ())
            losses.check_datum(i, d, vocab, [k for k in d.loss_fn_inputs if k in taken])
        stability = loss_fn == "stable_reinforce"
        return [self.service.sequences.resolve(owner, i, d, stability) for i, d in enumerate(data)]

    def check_options_and_provenance(self, data: list[Datum], loss_fn: str, loss_fn_config: dict | None,
                                     owner: str = LOCAL_OWNER) -> None:
        """The request-time part of `check_request` (what a server answers 400 to before queueing): unknown
        `loss_fn_config` options, data longer than the model's context, and provenance spans naming unknown, other
        owners' or mismatched sequences."""
        losses.check_config(loss_fn, loss_fn_config)
        self.check_context(data)
        for i, d in enumerate(data):
            if "target_tokens" in d.loss_fn_inputs:
                self.service.sequences.resolve(owner, i, d, loss_fn == "stable_reinforce")

    def check_context(self, data: list[Datum]) -> None:
        """Raise naming the datum whose model input is longer than the model's context."""
        losses.check_context(data, self.service.base.cfg.text.max_position_embeddings)

    def forward_backward_custom(self, data: list[Datum], loss_fn) -> APIFuture:
        """Any differentiable loss: `loss_fn(data, logprobs_list) -> (scalar loss, metrics)`; gradients accumulate."""
        if not callable(loss_fn):
            raise TypeError(f"forward_backward_custom: loss_fn must be callable (data, logprobs) -> (loss, metrics), "
                            f"got {type(loss_fn).__name__}")
        return self._exec.submit(self._forward_backward_custom, list(data), loss_fn)

    def optim_step(self, adam_params: AdamParams) -> APIFuture:
        """One AdamW step on the accumulated gradients, then zero them."""
        return self._exec.submit(self._optim_step, adam_params)

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False) -> APIFuture:
        """Weights + optimizer state -> `tinker://<run>/weights/<name>` (an existing name returns its path)."""
        check_ttl(ttl_seconds)  # now, not after the publish: a bad expiry must not leave a saved checkpoint behind
        return self._exec.submit(self._save, name, "weights", overwrite, ttl_seconds)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None) -> APIFuture:
        """Adapter weights -> `tinker://<run>/sampler_weights/<name>`."""
        check_ttl(ttl_seconds)
        return self._exec.submit(self._save, name, "sampler_weights", False, ttl_seconds)

    def save_weights_external(self, name: str, ttl_seconds: int | None = None) -> APIFuture:
        """Adapter weights -> `tinker://<run>/external_weights/<name>`, whose files download as a PEFT adapter."""
        check_ttl(ttl_seconds)
        return self._exec.submit(self._save, name, "external_weights", False, ttl_seconds)

    def load_state(self, path: str) -> APIFuture:
        """Load weights only (optimizer moments start fresh)."""
        return self._exec.submit(self._load, path, False)

    def load_state_with_optimizer(self, path: str) -> APIFuture:
        """Load weights and the optimizer state saved with them."""
        return self._exec.submit(self._load, path, True)

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: Any = None,
                                             record_stability_info: bool = False):
        """A SamplingClient on a snapshot of the current weights (waits for queued calls; `name` also saves)."""
        if name is not None:
            self.save_weights_for_sampler(name).result()
        client = self.snapshot_sampling_client().result()
        client.record_stability_info = bool(record_stability_info)
        return client

    def schedule_with(self, scheduler, policy: str, tenant: str = "") -> None:
        """Run each compute call of this client as one update turn of `scheduler` (a `PhaseScheduler`; how
        `dsv4flash serve` shares the base; `tenant`: whose call it is, for fairness). Snapshots and saves take no
        turn: they copy or write this run's own adapter and never touch the base, so another policy's compute may
        run meanwhile."""
        off_base = (self._snapshot_sampler, self._save)
        self._exec.gate = lambda fn: (contextlib.nullcontext() if fn in off_base
                                      else scheduler.turn(policy, "update", tenant))

    def release(self) -> None:
        """The run leaves memory (its session finished); its checkpoints stay in the store."""

    def run_ordered(self, fn, *args) -> APIFuture:
        """`fn(self, *args)` on this client's worker, in submission order with its other calls (extensions)."""
        return self._exec.submit(fn, self, *args)

    def snapshot_sampling_client(self) -> APIFuture:
        """A future SamplingClient on the weights as they stand after every call queued before this one."""
        return self._exec.submit(self._snapshot_sampler)

    def create_sampling_client(self, model_path: str, retry_config: Any = None, record_stability_info: bool = False):
        """A SamplingClient on saved sampler (or training) weights."""
        return self.service.create_sampling_client(model_path=model_path, record_stability_info=record_stability_info)

    def get_info(self):
        """Run id and what it is built on (`tinker.types.GetInfoResponse`; the placement is `self.placement`)."""
        t, base = _tinker_types(), self.service.base
        return t.GetInfoResponse(type="get_info", model_id=self.run_id, is_lora=True,
                                 lora_rank=int(self.placement.rank), model_name=base.base_model,
                                 model_data=t.ModelData(arch=str(base.cfg.model_type), model_name=base.base_model))

    def get_tokenizer(self):
        """The base model's tokenizer."""
        return self.service.get_tokenizer()

    # ---- async twins (Tinker: `fut = await tc.forward_backward_async(...)`; `out = await fut`) ----
    async def forward_async(self, *args, **kwargs) -> APIFuture:
        """Async twin of `forward`."""
        return self.forward(*args, **kwargs)

    async def forward_backward_async(self, *args, **kwargs) -> APIFuture:
        """Async twin of `forward_backward`."""
        return self.forward_backward(*args, **kwargs)

    async def forward_backward_custom_async(self, *args, **kwargs) -> APIFuture:
        """Async twin of `forward_backward_custom`."""
        return self.forward_backward_custom(*args, **kwargs)

    async def optim_step_async(self, *args, **kwargs) -> APIFuture:
        """Async twin of `optim_step`."""
        return self.optim_step(*args, **kwargs)

    async def save_state_async(self, *args, **kwargs) -> APIFuture:
        """Async twin of `save_state`."""
        return self.save_state(*args, **kwargs)

    async def save_weights_for_sampler_async(self, *args, **kwargs) -> APIFuture:
        """Async twin of `save_weights_for_sampler`."""
        return self.save_weights_for_sampler(*args, **kwargs)

    async def save_weights_external_async(self, *args, **kwargs) -> APIFuture:
        """Async twin of `save_weights_external`."""
        return self.save_weights_external(*args, **kwargs)

    # ---- work (on this client's worker thread) ----
    def _snapshot_sampler(self):
        snapshot, _ = self._trainer_state(with_optimizer=False)
        return self.service._sampling_client(self.placement, snapshot, f"{self.run_id}/live-{self.step}",
                                             policy=self.run_id, step=self.step)

    def _forward_backward(self, data, loss_fn, loss_fn_config, backward: bool, owner: str) -> ForwardBackwardOutput:
        provenance = self.check_request(data, loss_fn, loss_fn_config, owner)
        logps, per, total = self._run_loss(data, loss_fn, loss_fn_config, provenance, backward)
        outputs = [{"logprobs": TensorData.from_torch(lp.detach()), "loss": TensorData.from_torch(l.detach().reshape(1))}
                   for lp, l in zip(logps, per)]
        return ForwardBackwardOutput(loss_fn, outputs, {"loss:sum": float(total.detach())})

    def _run_loss(self, data, loss_fn, loss_fn_config, provenance, backward: bool):
        """(target log-probs, per-datum losses, their sum) of a checked request; with `backward`, the gradients of
        the sum are accumulated (the trainer backend's part: here the resident base in this process)."""
        base = self.service.base
        with base.bind(self.placement, self.adapter) as model, torch.set_grad_enabled(backward):
            logps = target_logprobs(model, data)
            per, total = self._losses(logps, data, loss_fn, loss_fn_config, provenance, backward)
        return logps, per, total

    def _losses(self, logps, data, loss_fn, loss_fn_config, provenance, backward: bool):
        """(per-datum losses, their sum) of the target log-probs; with `backward` the sum's gradients are kept
        (`_keep_gradients`), else a non-finite sum is refused."""
        per = datum_losses(loss_fn, loss_fn_config, logps, data, provenance)
        total = torch.stack(per).sum()
        if backward:
            self._keep_gradients(total, f"forward_backward({loss_fn!r})")
        elif not torch.isfinite(total):
            raise NonFiniteError(f"forward({loss_fn!r}): the loss is {float(total)}")
        return per, total

    def _keep_gradients(self, loss: torch.Tensor, what: str) -> None:
        """The trainer backend's gradient step of a checked loss (here: accumulate d loss / d adapter)."""
        self._accumulate_gradients(loss, what)

    def _forward_backward_custom(self, data, loss_fn) -> ForwardBackwardOutput:
        if not data:
            raise ValueError("forward_backward_custom: empty data list")
        self.check_context(data)
        vocab = self.service.base.cfg.text.vocab_size
        for i, d in enumerate(data):
            if "target_tokens" not in d.loss_fn_inputs:
                raise KeyError(f"datum {i}: forward_backward_custom needs loss_fn_inputs['target_tokens']")
            losses.check_datum(i, d, vocab, ["target_tokens"])  # the other inputs are the custom loss's own
        logps, loss, metrics = self._run_custom(data, loss_fn)
        outputs = [{"logprobs": TensorData.from_torch(lp.detach())} for lp in logps]
        return ForwardBackwardOutput("custom", outputs, {**{k: float(v) for k, v in (metrics or {}).items()},
                                                         "loss:sum": float(loss.detach())})

    def _run_custom(self, data, loss_fn):
        """(target log-probs, the custom loss, its metrics) with the loss's gradients accumulated."""
        # Embedded, so the user's loss sees live log-probs and backprops through the model in one pass (Tinker
        # does a forward, then a second forward_backward with the loss's gradient w.r.t. the log-probs).
        with self.service.base.bind(self.placement, self.adapter) as model, torch.enable_grad():
            logps = target_logprobs(model, data)
            loss, metrics = call_custom_loss(loss_fn, data, logps)
            self._accumulate_gradients(loss.reshape(()), "forward_backward_custom")
        return logps, loss, metrics

    def _accumulate_gradients(self, loss: torch.Tensor, what: str) -> None:
        """Add d loss / d adapter to the accumulated gradients, or refuse (nothing added) if any is non-finite."""
        calls.check()  # the last point where stopping the call leaves the run unchanged
        if not torch.isfinite(loss):
            raise NonFiniteError(f"{what}: the loss is {float(loss.detach())}; refused, gradients and adapter "
                                 f"unchanged")
        names = list(self.adapter)
        grads = torch.autograd.grad(loss, [self.adapter[n] for n in names], allow_unused=True)
        for name, grad in zip(names, grads):
            if grad is not None and not torch.isfinite(grad).all():
                raise NonFiniteError(f"{what}: the gradient of adapter tensor {name} is not finite; refused, "
                                     f"gradients and adapter unchanged")
        for name, grad in zip(names, grads):
            if grad is not None:
                param = self.adapter[name]
                param.grad = grad if param.grad is None else param.grad.add_(grad)

    def _optim_step(self, hp: AdamParams):
        check_adam_params(hp)
        params = list(self.adapter.values())
        before = {k: p.detach().clone() for k, p in self.adapter.items()}
        previous = self.optimizer
        saved = copy.deepcopy(previous.state_dict()) if previous is not None else None
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(params, lr=hp.learning_rate)
        for g in self.optimizer.param_groups:
            g.update(lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay)
        norm = None
        if hp.grad_clip_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(params, hp.grad_clip_norm))
        self.optimizer.step()
        bad = next((k for k, p in self.adapter.items() if not torch.isfinite(p).all()), None)
        if bad is not None:  # undo: weights and moments as before the step; the gradients stay for a retry
            with torch.no_grad():
                for k, p in self.adapter.items():
                    p.copy_(before[k])
            if previous is None:
                self.optimizer = None
            else:
                previous.load_state_dict(saved)
            raise NonFiniteError(f"optim_step: the update makes adapter tensor {bad} non-finite; refused, adapter "
                                 f"and optimizer state unchanged")
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return _tinker_types().OptimStepResponse(metrics={"step": float(self.step),
                                                          **({"grad_norm": norm} if norm is not None else {})})

    def _save(self, name: str, kind: str, overwrite: bool, ttl_seconds: float | None = None):
        path = f"tinker://{self.run_id}/{kind}/{name}"
        tag = ParsedCheckpointTinkerPath.from_tinker_path(path).tag
        store = self.service.store
        t = _tinker_types()
        response = {"weights": t.SaveWeightsResponse, "sampler_weights": t.SaveWeightsForSamplerResponse,
                    "external_weights": t.SaveWeightsExternalResponse}[kind]
        if self.service.checkpoints.is_expired(path):
            self.service.expire_checkpoints()  # an expired name is free again
        if not overwrite and tag in store.catalog.tags(self.run_id):
            return response(path=path)  # idempotent save-by-name (Tinker's 409 -> same path)
        tensors, optimizer_state = self._trainer_state(with_optimizer=kind == "weights")
        blob = None
        if kind == "weights":
            buf = io.BytesIO()
            torch.save({"optimizer": optimizer_state, "step": self.step}, buf)
            blob = buf.getvalue()
        with self.service.store_lock:
            store.publish(self.run_id, tensors, step=self.step, trainer_state=blob, tags=[tag],
                          extra={"placement": self.placement.to_dict(), "kind": kind, "name": name})
        self.service.checkpoints.set(path, ttl_seconds=ttl_seconds)  # also clears an older expiry on overwrite
        return response(path=path)

    def _trainer_state(self, with_optimizer: bool):
        """(a copy of the adapter tensors, the optimizer's `state_dict()` or None) as a checkpoint stores them."""
        tensors = {k: p.detach().clone() for k, p in self.adapter.items()}
        return tensors, (self.optimizer.state_dict() if with_optimizer and self.optimizer else None)

    def _load(self, path: str, with_optimizer: bool):
        tensors, state, _ = self.service._read_checkpoint(path, with_optimizer)
        if set(tensors) != set(self.adapter_shapes()):
            raise KeyError(f"{path}: adapter tensors do not match this run's placement "
                           f"({self.placement.preset!r}, rank {self.placement.rank})")
        for k, shape in self.adapter_shapes().items():
            if tuple(tensors[k].shape) != tuple(shape):
                raise ValueError(f"{path}: tensor {k} has shape {list(tensors[k].shape)}, expected {list(shape)}")
        optimizer = None
        if with_optimizer:
            if state is None or state.get("optimizer") is None:
                raise ValueError(f"{path}: holds no optimizer state (saved with save_weights_for_sampler, or before "
                                 f"any optim_step)")
            optimizer = state["optimizer"]
        self._apply_state(tensors, optimizer, int(state["step"]) if optimizer is not None else None)
        return _tinker_types().LoadWeightsResponse(path=path)

    def adapter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical adapter key -> shape of this run's placement."""
        return {k: tuple(p.shape) for k, p in self.adapter.items()}

    def _apply_state(self, tensors: dict[str, torch.Tensor], optimizer: dict | None, step: int | None) -> None:
        """Make checked checkpoint tensors the adapter; with an optimizer `state_dict` also the moments and step
        (without one the moments start fresh and the step count stays)."""
        with torch.no_grad():
            for k, p in self.adapter.items():
                p.copy_(tensors[k])
                p.grad = None
        self.optimizer = None
        if optimizer is not None:
            self.optimizer = torch.optim.AdamW(list(self.adapter.values()))
            self.optimizer.load_state_dict(optimizer)
            self.step = step
