"""`ServiceClient`: the entry point (Tinker names); owns the resident base and the lifecycle store."""

from __future__ import annotations

import io
import itertools
import shutil
import tempfile
import threading
from pathlib import Path

import torch

from dsv4flash.lora import LoraConfig as PlacementConfig
from dsv4flash.service.compute.resident import ResidentBase
from dsv4flash.service.compute.sampling import SamplingClient
from dsv4flash.service.compute.training import TrainingClient
from dsv4flash.service.plane.checkpoints import CheckpointRegistry
from dsv4flash.service.types import ParsedCheckpointTinkerPath

_run_counter = itertools.count()


class ServiceClient:
    """Embedded service: one resident base (`base_model` config) and an `AdapterStore` at `root`."""

    def __init__(self, base_model: str = "tiny", *, root: str | Path | None = None, base_dir: str | Path | None = None,
                 seed: int = 0, resident: ResidentBase | None = None, api_key: str | None = None,
                 base_url: str | None = None, user_metadata: dict | None = None) -> None:
        from dsv4flash.lifecycle import AdapterStore

        del api_key, base_url, user_metadata  # Tinker/MinT remote settings: meaningless for the embedded service

        self.base = resident or ResidentBase(base_model, base_dir=base_dir, seed=seed)
        self._tmp = tempfile.TemporaryDirectory(prefix="dsv4flash-service-") if root is None else None
        self.root = Path(root if root is not None else self._tmp.name)
        self.store = AdapterStore(self.root)
        self.store_lock = threading.Lock()
        self.checkpoints = CheckpointRegistry(self.root)
        from dsv4flash.service.compute.stability import SequenceRecords

        self.sequences = SequenceRecords()  # record_stability_info samples, for stable_reinforce's provenance
        self._tokenizer = None
        # At start, not on the first create_lora_training_client: the census behind it builds the model on meta
        # (seconds in a fresh process, torch's meta-init path included), which would otherwise stall the first
        # tenant, and concurrent first clients would each compute it.
        from dsv4flash.lifecycle import base_fingerprint

        self._fingerprint = base_fingerprint(self.base.cfg)

    def get_server_capabilities(self) -> dict:
        """The one base model this embedded service holds."""
        return {"supported_models": [{"model_name": self.base.base_model}]}

    def create_lora_training_client(self, base_model: str | None = None, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    user_metadata: dict | None = None, *, preset: str = "full_linear",
                                    run_id: str | None = None, **placement) -> TrainingClient:
        """A new LoRA run; `preset` (and extra LoraConfig fields) choose the dsv4flash placement."""
        if base_model is not None and base_model != self.base.base_model:
            raise ValueError(f"create_lora_training_client: base_model {base_model!r} is not the resident base "
                             f"{self.base.base_model!r}")
        if not (train_mlp or train_attn):
            raise ValueError("create_lora_training_client: train_mlp and train_attn are both False: nothing to adapt")
        exclude = list(placement.pop("exclude", []) or [])
        if not train_mlp:
            exclude += ["layers.*.ffn.**", "layers.*.engram.*"]
        if not train_attn:
            exclude += ["layers.*.attn.**"]
        # The reference model keeps the head frozen (no unembed LoRA); train_unembed is accepted and ignored.
        pc = PlacementConfig(preset=preset, rank=int(rank), seed=int(seed or 0), exclude=exclude or None, **placement)
        run_id = run_id or f"run-{next(_run_counter)}-{id(self) & 0xFFFF:04x}"
        self.store.create_policy(run_id, self.fingerprint(), {
            "user_metadata": dict(user_metadata or {}),
            "dsv4flash_service": {"base_model": self.base.base_model, "lora_rank": pc.rank, "preset": pc.preset}})
        return TrainingClient(self, run_id, pc, self.base.fresh_adapter(pc))

    def create_training_client_from_state(self, path: str, user_metadata: dict | None = None, *,
                                          run_id: str | None = None) -> TrainingClient:
        """A new run initialised with the weights of a `weights/` checkpoint."""
        return self._from_state(path, False, user_metadata, run_id)

    def create_training_client_from_state_with_optimizer(self, path: str, user_metadata: dict | None = None, *,
                                                         run_id: str | None = None):
        """A new run initialised with weights and optimizer state."""
        return self._from_state(path, True, user_metadata, run_id)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config=None, record_stability_info: bool = False) -> SamplingClient:
        """Sample from a saved checkpoint, or from the bare base when only `base_model` is given."""
        if model_path is None:
            client = SamplingClient(self, None, None, "base")
        else:
            tensors, _, pc = self._read_checkpoint(model_path, False)
            client = SamplingClient(self, pc, tensors,
                                    ParsedCheckpointTinkerPath.from_tinker_path(model_path).checkpoint_id)
        client.record_stability_info = bool(record_stability_info)
        return client

    def create_rest_client(self):
        """Run and checkpoint management (list, delete, publish, TTL, archive URL)."""
        from dsv4flash.service.rest import RestClient

        return RestClient(self)

    # ---- checkpoint retention ----
    def require_checkpoint(self, path: str):
        """The catalog revision behind a checkpoint path; FileNotFoundError if it is absent, deleted or expired."""
        parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
        if self.checkpoints.is_expired(path):
            raise FileNotFoundError(f"checkpoint {path}: expired (ttl_seconds) and no longer served")
        try:
            return self.store.resolve(f"{parsed.training_run_id}:{parsed.tag}")
        except Exception as exc:
            raise FileNotFoundError(f"checkpoint {path}: not in the store at {self.root} ({exc})") from exc

    def archive_dir(self, path: str, revision_id: str) -> Path:
        """Where a checkpoint's PEFT archive goes (per revision: a name saved again gets a fresh archive)."""
        parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
        return self.root / "service" / "archives" / parsed.training_run_id / f"{parsed.tag}.{revision_id[:16]}"

    def delete_checkpoint(self, path: str) -> None:
        """Remove a checkpoint's name and its archives; the revision is retired unless the head or another name
        still uses it."""
        from dsv4flash.lifecycle.errors import ReferencedRevisionError, RevisionNotFoundError

        parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
        with self.store_lock:
            try:
                rev_id = self.store.catalog.untag(parsed.training_run_id, parsed.tag, reason="delete")
            except RevisionNotFoundError as exc:
                raise FileNotFoundError(f"checkpoint {path}: not in the store at {self.root} ({exc})") from exc
            try:
                self.store.catalog.retire(rev_id)
            except ReferencedRevisionError:
                pass  # still the run's head or another checkpoint's revision: its bytes stay
            self.checkpoints.forget(path)
            shutil.rmtree(self.archive_dir(path, rev_id), ignore_errors=True)

    def expire_checkpoints(self, now: float | None = None) -> list[str]:
        """Delete every checkpoint whose TTL has passed -> their paths."""
        gone = []
        for path in self.checkpoints.expired(now):
            try:
                self.delete_checkpoint(path)
            except FileNotFoundError:
                self.checkpoints.forget(path)  # deleted another way meanwhile
            gone.append(path)
        return gone

    def gc(self, *, grace_s: float = 3600.0, dry_run: bool = False):
        """Expire checkpoints past their TTL, then free blobs no live revision references (`AdapterStore.gc`)."""
        if not dry_run:
            self.expire_checkpoints()
        return self.store.gc(grace_s=grace_s, dry_run=dry_run)

    def get_tokenizer(self):
        """A TaskTokenizer for the base config."""
        if self._tokenizer is None:
            from dsv4flash.tasks import TaskTokenizer

            self._tokenizer = TaskTokenizer(self.base.cfg)
        return self._tokenizer

    def stop_sequences(self, stop) -> list[tuple[int, ...]]:
        """Stop token sequences from token ids and stop strings (each string as its token ids; eos always stops).

        A string stops sampling once the sampled tokens end with its encoding (a token-level match: a string the
        model spells with other tokens does not stop it)."""
        out = [(int(self.base.cfg.eos_token_id),)]
        for s in [stop] if isinstance(stop, (str, int)) else (stop or []):
            if isinstance(s, int):
                out.append((s,))
            else:
                ids = tuple(int(t) for t in self.get_tokenizer().encode(s))
                if not ids:
                    raise ValueError(f"SamplingParams.stop: {s!r} encodes to no tokens")
                out.append(ids)
        return out

    def fingerprint(self):
        """The resident base's lifecycle fingerprint (computed once, when the service starts)."""
        return self._fingerprint

    # ---- internals ----
    def _sampling_client(self, placement, adapter, name) -> SamplingClient:
        return SamplingClient(self, placement, adapter, name)

    def _read_checkpoint(self, path: str, with_state: bool):
        """(adapter tensors, trainer state or None, placement) of a checkpoint, from one read of its revision."""
        from dsv4flash.lifecycle.revision import decode_adapter

        parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
        rec = self.require_checkpoint(path)
        loaded = self.store.load(rec.id, resident_base=self.fingerprint())
        tensors = dict(decode_adapter(loaded.tensors, loaded.manifest, source=f"checkpoint {path}"))
        placement = PlacementConfig.from_dict(dict(loaded.manifest.extra["placement"]))
        state = None
        if with_state:
            _, blob = self.store.trainer_state(parsed.training_run_id, rec.id)
            state = torch.load(io.BytesIO(blob), weights_only=False) if blob is not None else None
        return tensors, state, placement

    def _from_state(self, path: str, with_optimizer: bool, user_metadata: dict | None = None,
                    run_id: str | None = None) -> TrainingClient:
        pc = self._read_checkpoint(path, False)[2]
        client = self.create_lora_training_client(rank=pc.rank, user_metadata=user_metadata, run_id=run_id,
                                                  **{k: v for k, v in pc.to_dict().items()
                                                     if k not in ("rank", "include_from_preset")})
        (client.load_state_with_optimizer if with_optimizer else client.load_state)(path).result()
        return client
