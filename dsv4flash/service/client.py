"""`ServiceClient`: the entry point (Tinker names); owns the resident base and the lifecycle store."""

from __future__ import annotations

import io
import itertools
import shutil
import tempfile
import threading
from pathlib import Path

import torch

from dsv4flash.lifecycle.refs import SERVICE_META, ParsedCheckpointTinkerPath, checkpoint_ref, is_server_run
from dsv4flash.lora import LoraConfig as PlacementConfig
from dsv4flash.engine.resident import ResidentBase
from dsv4flash.service.compute.sampling import SamplingClient
from dsv4flash.service.compute.training import TrainingClient
from dsv4flash.service.plane.checkpoints import CheckpointIntegrityError, CheckpointRegistry

_run_counter = itertools.count()


class ServiceClient:
    """Embedded service: one resident base (`base_model` config) and an `AdapterStore` at `root` (a directory or an
    s3:// URL); the server's own files go under `state_dir` (default: the store directory, or this machine's
    directory for an s3:// store, `dsv4flash.lifecycle.default_store.local_dir_for`). `device`/`dtype` place a
    base this client builds (`ResidentBase`: auto = CUDA in bfloat16 when present, else the CPU in float32)."""

    def __init__(self, base_model: str = "tiny", *, root: str | Path | None = None, base_dir: str | Path | None = None,
                 seed: int = 0, resident: ResidentBase | None = None, api_key: str | None = None,
                 base_url: str | None = None, user_metadata: dict | None = None,
                 state_dir: str | Path | None = None, device: str = "auto", dtype: str = "auto",
                 plane=None, log=None) -> None:
        from dsv4flash.lifecycle import AdapterStore
        from dsv4flash.lifecycle.default_store import local_dir_for, store_location

        del api_key, base_url, user_metadata  # Tinker/MinT remote settings: meaningless for the embedded service

        self._tmp = tempfile.TemporaryDirectory(prefix="dsv4flash-service-") if root is None else None
        self.root = store_location(root if root is not None else self._tmp.name)
        self.state_root = Path(state_dir) if state_dir is not None else local_dir_for(self.root)
        self.store = AdapterStore(self.root)  # before the base: a store that cannot open is refused in a moment
        self.base = resident or ResidentBase(base_model, base_dir=base_dir, seed=seed, device=device, dtype=dtype)
        self.store_lock = threading.Lock()
        self._archive_lock = threading.Lock()  # two downloads of a fresh checkpoint export it once
        self.checkpoints = CheckpointRegistry(self.state_root)
        from dsv4flash.service.compute.stability import SequenceRecords

        self.sequences = SequenceRecords()  # record_stability_info samples, for stable_reinforce's provenance
        self._tokenizer = None
        # How stop strings become token ids: the task tokenizer in-process; `dsv4flash serve` sets the encoder of the
        # tokenizer it serves, since its clients write stop strings in that tokenizer's text (any text, whitespace too).
        self.text_encoder = None
        # At start, not on the first create_lora_training_client: the census behind it builds the model on meta
        # (seconds in a fresh process, torch's meta-init path included), which would otherwise stall the first
        # tenant, and concurrent first clients would each compute it.
        from dsv4flash.lifecycle import base_fingerprint

        self._fingerprint = base_fingerprint(self.base.cfg)
        self.serving = None  # `enable_serving`: the tiers + continuous batcher every sampling call then goes through
        # The compute plane (`dsv4flash serve --trainer/--sampler`): None or trainer "local" trains in this process
        # on the resident base; "megatron" on a veRL Megatron worker group on Ray (compute/megatron/).
        self.plane = plane
        self.trainer_group = None
        self.replicas = None  # `--sampler dsv4flash`: the sampler replicas (compute/replicas.py)
        self._base_dir = Path(base_dir) if base_dir is not None else None
        self._snapshots: dict[str, str] = {}  # run -> the revision of its last sampler snapshot
        log = log or (lambda line: None)
        if plane is not None and plane.trainer == "megatron":
            self.trainer_group = self._start_trainer_group(log)
        if plane is not None and plane.sampler in ("dsv4flash", "vllm"):
            from dsv4flash.service.compute.replicas import ReplicaPool

            log(f"samplers: starting {plane.replicas} {plane.sampler} replica(s)")
            self.replicas = ReplicaPool(plane, base_dir=self.served_base_dir(), store=str(self.root),
                                        fingerprint=self._fingerprint, replicas=plane.replicas,
                                        max_adapters=plane.max_adapters)

    def enable_serving(self, **options):
        """Serve sampling through the lifecycle's tiers and the continuous batcher (`compute/serving.Serving`
        options: max_loras, max_cpu_loras, max_queue, exact, …) -> the Serving object."""
        from dsv4flash.service.compute.serving import Serving

        if self.serving is None:
            self.serving = Serving(self, **options)
        return self.serving

    def get_server_capabilities(self) -> dict:
        """The one base model this embedded service holds."""
        return {"supported_models": [{"model_name": self.base.base_model}]}

    def create_lora_training_client(self, base_model: str | None = None, rank: int | None = None,
                                    seed: int | None = None, train_mlp: bool = True, train_attn: bool = True,
                                    train_unembed: bool = True, user_metadata: dict | None = None, *,
                                    preset: str | None = None, run_id: str | None = None,
                                    **placement) -> TrainingClient:
        """A new LoRA run; `preset` (and extra LoraConfig fields) choose the dsv4flash placement (None: the
        server's default, `full_linear`, or the trainer group's shell preset under `--trainer megatron`).

        `rank=None` takes the preset's rank (Tinker's signature defaults to 32; the SDK always sends one)."""
        if base_model is not None and base_model != self.base.base_model:
            raise ValueError(f"create_lora_training_client: base_model {base_model!r} is not the resident base "
                             f"{self.base.base_model!r}")
        pc = self.placement(rank=rank, seed=seed, train_mlp=train_mlp, train_attn=train_attn,
                            train_unembed=train_unembed, preset=preset, **placement)
        return self._new_run(pc, user_metadata, run_id)

    @property
    def default_preset(self) -> str:
        """The placement preset of a run that names none: the trainer group's shell preset, else `full_linear`."""
        return self.plane.placement if self.trainer_group is not None else "full_linear"

    def placement(self, *, rank: int | None = None, seed: int | None = None, train_mlp: bool = True,
                  train_attn: bool = True, train_unembed: bool = True, preset: str | None = None,
                  **placement) -> PlacementConfig:
        """The placement of a Tinker `create_lora_training_client` call (ValueError naming the field if invalid)."""
        preset = self.default_preset if preset is None else preset
        if not (train_mlp or train_attn):
            raise ValueError("create_lora_training_client: train_mlp and train_attn are both False: nothing to adapt")
        if "train_head" in placement:
            raise ValueError("create_lora_training_client: pass train_unembed (Tinker's name), not train_head")
        exclude = list(placement.pop("exclude", []) or [])
        if not train_mlp:
            exclude += ["layers.*.ffn.**", "layers.*.engram.*"]
        if not train_attn:
            exclude += ["layers.*.attn.**"]
        return PlacementConfig(preset=preset, rank=None if rank is None else int(rank), seed=int(seed or 0),
                               exclude=exclude or None, train_head=bool(train_unembed), **placement)

    def create_training_client_from_state(self, path: str, user_metadata: dict | None = None, *,
                                          run_id: str | None = None) -> TrainingClient:
        """A new run initialised with the weights of a `weights/` checkpoint."""
        return self._from_state(path, False, user_metadata, run_id)

    def create_training_client_from_state_with_optimizer(self, path: str, user_metadata: dict | None = None, *,
                                                         run_id: str | None = None):
        """A new run initialised with weights and optimizer state."""
        return self._from_state(path, True, user_metadata, run_id)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config=None, record_stability_info: bool = False, *,
                               revision: str | None = None) -> SamplingClient:
        """Sample from a saved checkpoint, a catalog revision (its full id: names no checkpoint path spells, like
        `<policy>@<revision>`), or the bare base when only `base_model` is given."""
        if revision is not None:
            if model_path is not None:
                raise ValueError("create_sampling_client: give model_path or revision, not both")
            if self.serving is not None:  # through the tiers like a checkpoint: slots, CPU cache, accounting
                placement, figure = self._check_through_tiers(f"revision {revision[:12]}", revision)
                client = SamplingClient(self, placement, None, revision[:12], revision=revision, loaded=figure)
            else:
                tensors, placement = self._read_revision(revision, f"revision {revision[:12]}")
                client = SamplingClient(self, placement, tensors, revision[:12])
        elif self.replicas is not None:  # published revisions sample on the replicas, by version-qualified name
            from dsv4flash.service.compute.replicas import ReplicaSamplingClient, qualified_name

            if model_path is None:
                client = ReplicaSamplingClient(self, None, None, "base")
            else:
                rec = self.require_checkpoint(model_path)
                client = ReplicaSamplingClient(self, None, rec.id, qualified_name(rec.policy, rec.id))
        elif model_path is None:
            client = SamplingClient(self, None, None, "base")
        elif self.serving is not None:  # the adapter comes from the tiers per call; reading it now checks it
            rec = self.require_checkpoint(model_path)
            placement, figure = self._check_through_tiers(model_path, rec.id)
            client = SamplingClient(self, placement, None,
                                    ParsedCheckpointTinkerPath.from_tinker_path(model_path).checkpoint_id,
                                    revision=rec.id, loaded=figure)
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
    def is_trained_policy(self, name: str) -> bool:
        """A policy published into the store from outside the server (a training run, `dsv4flash lifecycle import`),
        not one of the server's own runs: read-only here, its tags (latest, step-N, head) are its checkpoints."""
        from dsv4flash.lifecycle.errors import PolicyNotFoundError

        try:
            return not is_server_run(self.store.catalog.policy(name).meta)
        except PolicyNotFoundError:
            return False

    def checkpoint_ref(self, path: str) -> str:
        """The catalog ref of a checkpoint path: `<run>:<kind>.<name>` for a run of this server, `<policy>:<name>`
        for a trained policy (`tinker://decoder_lora/weights/latest` is `decoder_lora:latest`)."""
        parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
        return checkpoint_ref(parsed, not self.is_trained_policy(parsed.training_run_id))

    def require_checkpoint(self, path: str):
        """The catalog revision behind a checkpoint path; FileNotFoundError if it is absent, deleted or expired."""
        if self.checkpoints.is_expired(path):
            raise FileNotFoundError(f"checkpoint {path}: expired (ttl_seconds) and no longer served")
        try:
            return self.store.resolve(self.checkpoint_ref(path))
        except Exception as exc:
            raise FileNotFoundError(f"checkpoint {path}: not in the store at {self.root} ({exc})") from exc

    def archive_dir(self, path: str, revision_id: str) -> Path:
        """Where a checkpoint's PEFT archive goes (per revision: a name saved again gets a fresh archive)."""
        parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
        return self.state_root / "service" / "archives" / parsed.training_run_id / f"{parsed.tag}.{revision_id[:16]}"

    def peft_archive(self, path: str) -> tuple[Path, str]:
        """(the checkpoint exported as a PEFT adapter directory, written once per revision, its revision id)."""
        from dsv4flash.lora import save_peft_adapter

        rev_id = self.require_checkpoint(path).id
        target = self.archive_dir(path, rev_id)
        with self._archive_lock:
            if not target.exists():
                tensors, _, placement = self._read_checkpoint(path, False)
                with self.base.bind(placement, tensors) as shell:
                    save_peft_adapter(shell, None, target, base_model_name_or_path=self.base.base_model)
        return target, rev_id

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
                ids = tuple(int(t) for t in (self.text_encoder or self.get_tokenizer().encode)(s))
                if not ids:
                    raise ValueError(f"SamplingParams.stop: {s!r} encodes to no tokens")
                out.append(ids)
        return out

    def fingerprint(self):
        """The resident base's lifecycle fingerprint (computed once, when the service starts)."""
        return self._fingerprint

    def _check_through_tiers(self, path: str, revision: str):
        """Load a checkpoint's revision into a slot (accounted, left resident) -> (its placement, the LoadFigure);
        damage is a `CheckpointIntegrityError` naming the path, as for every other reader."""
        from dsv4flash.lifecycle.errors import BaseMismatchError, LifecycleError, SlotQueueFull

        try:
            with self.serving.adapter(revision) as (placement, _, figure):
                return placement, figure
        except (BaseMismatchError, SlotQueueFull):
            raise
        except LifecycleError as exc:
            raise CheckpointIntegrityError(path, exc) from exc

    # ---- internals ----
    def _sampling_client(self, placement, adapter, name, policy: str | None = None, step: int | None = None):
        """A sampling client on a snapshot of a run's adapter; with sampler replicas the snapshot is published as
        an adapter-only revision of the run first (the previous snapshot's revision is retired)."""
        if self.replicas is None or policy is None:  # a trainer group's adapter arrives on the CPU: bind it here
            return SamplingClient(self, placement, self.base.to_device(adapter), name)
        from dsv4flash.lifecycle.errors import ReferencedRevisionError
        from dsv4flash.service.compute.replicas import ReplicaSamplingClient, qualified_name

        with self.store_lock:
            rev = self.store.publish(policy, {k: v.detach().cpu() for k, v in adapter.items()}, step=step,
                                     extra={"placement": placement.to_dict(), "kind": "sampler_snapshot"})
            previous, self._snapshots[policy] = self._snapshots.get(policy), rev.id
            if previous is not None and previous != rev.id:
                try:
                    self.store.catalog.retire(previous)
                except ReferencedRevisionError:
                    pass  # a checkpoint name points at the same bytes: they stay
        return ReplicaSamplingClient(self, placement, rev.id, qualified_name(policy, rev.id))

    def _read_checkpoint(self, path: str, with_state: bool):
        """(adapter tensors, trainer state or None, placement) of a checkpoint, from one read of its revision; the
        one reader of checkpoint bytes, so damage is reported alike everywhere (`CheckpointIntegrityError`)."""
        from dsv4flash.lifecycle.errors import LifecycleError

        parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
        rec = self.require_checkpoint(path)
        if with_state and self.is_trained_policy(parsed.training_run_id):
            raise ValueError(f"{path}: a policy trained outside this server; its optimizer state is its trainer's "
                             "(resume the run there); load its weights alone (create_training_client_from_state)")
        tensors, placement = self._read_revision(rec.id, f"checkpoint {path}", path)
        state = None
        if with_state:
            try:
                _, blob = self.store.trainer_state(parsed.training_run_id, rec.id)
            except LifecycleError as exc:
                raise CheckpointIntegrityError(path, exc) from exc
            # the optimizer moves its moments onto the adapter's device when it loads them
            state = (torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False) if blob is not None
                     else None)
        return tensors, state, placement

    def _read_revision(self, rev_id: str, source: str, path: str | None = None):
        """(adapter tensors, placement) of one catalog revision, hash-verified against the resident base; damage is
        a `CheckpointIntegrityError` naming `path` (else `source`)."""
        from dsv4flash.lifecycle.errors import BaseMismatchError, LifecycleError
        from dsv4flash.service.compute.serving import decode_loaded

        try:
            loaded = self.store.load(rev_id, resident_base=self.fingerprint())
            tensors, placement = decode_loaded(loaded, source)  # the one decoding, the serving tiers' too
            tensors = self.base.to_device(tensors)
        except BaseMismatchError:
            raise  # intact bytes of another base: not damage
        except LifecycleError as exc:  # a hash mismatch, an unparsable header or missing bytes: all damage
            raise CheckpointIntegrityError(path or source, exc) from exc
        return tensors, placement

    def _new_run(self, pc: PlacementConfig, user_metadata: dict | None, run_id: str | None) -> TrainingClient:
        """A fresh adapter of placement `pc` as a new policy of the store (on the trainer group when there is one:
        admitted first, so a policy it cannot hold leaves nothing behind)."""
        run_id = run_id or f"run-{next(_run_counter)}-{id(self) & 0xFFFF:04x}"
        fresh = self.base.fresh_adapter(pc)
        if self.trainer_group is not None:
            self.trainer_group.admit({k: tuple(v.shape) for k, v in fresh.items()}, int(pc.rank), self.fingerprint())
        self.store.create_policy(run_id, self.fingerprint(), {
            "user_metadata": dict(user_metadata or {}),
            SERVICE_META: {"base_model": self.base.base_model, "rank": pc.rank, "preset": pc.preset,
                           "train_head": pc.train_head}})
        if self.trainer_group is not None:
            from dsv4flash.service.compute.megatron.client import MegatronTrainingClient

            return MegatronTrainingClient(self, run_id, pc, self.trainer_group, fresh)
        return TrainingClient(self, run_id, pc, fresh)

    def admit(self, placement: PlacementConfig) -> None:
        """Refuse (`AdmissionError` naming the field) a placement the trainer cannot hold: with the Megatron group,
        a module outside its shell or a rank above its maximum; the local trainer holds every placement."""
        if self.trainer_group is not None:
            from dsv4flash.lora import lora_parameters

            shapes = {k: tuple(p.shape) for k, p in lora_parameters(self.base.shell(placement)).items()}
            self.trainer_group.admit(shapes, int(placement.rank), self.fingerprint())

    def admit_checkpoint(self, path: str) -> None:
        """Refuse a checkpoint a new run cannot start from: trained on another base (`AdmissionError` naming it), or
        of a placement the trainer cannot hold."""
        from dsv4flash.service.plane.admission import check_base

        rec = self.require_checkpoint(path)
        check_base(rec.base, self.fingerprint(), f"checkpoint {path}")
        if self.trainer_group is not None:
            self.admit(self._read_checkpoint(path, False)[2])

    def served_base_dir(self) -> Path:
        """The served base as a base directory the compute plane's workers load (the one the server was given; a
        seeded initialisation is written to `<state>/service/base` first)."""
        if self._base_dir is None:
            from dsv4flash.engine.model_io import save_base
            from dsv4flash.tasks import TaskTokenizer

            self._base_dir = save_base(self.base.model, self.base.cfg, TaskTokenizer(self.base.cfg),
                                       self.state_root / "service" / "base",
                                       {"kind": "served-base", "fingerprint": self._fingerprint.to_json()})
        return self._base_dir

    def _start_trainer_group(self, log):
        """Start the Megatron trainer group on this service's base."""
        from dsv4flash.service.compute.megatron.group import MegatronGroup

        group = MegatronGroup(self.plane, base_dir=self.served_base_dir(), cfg=self.base.cfg,
                              fingerprint=self._fingerprint, work_dir=self.state_root / "service" / "trainer")
        group.start(log=log)
        return group

    def _from_state(self, path: str, with_optimizer: bool, user_metadata: dict | None = None,
                    run_id: str | None = None) -> TrainingClient:
        client = self._new_run(self._read_checkpoint(path, False)[2], user_metadata, run_id)
        (client.load_state_with_optimizer if with_optimizer else client.load_state)(path).result()
        return client
