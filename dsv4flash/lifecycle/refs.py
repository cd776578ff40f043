"""The names of adapter revisions: catalog references, checkpoint paths, Tinker model ids, served model names,
the vLLM LoRA id.

One grammar for the whole tree; every front end (the service, the vLLM resolver, the catalog) parses with
these functions and nothing else.

* Catalog reference: `<policy>` (its head) or `<policy>:<tag>`; the tag is everything after the first `:`.
* Checkpoint path: `tinker://<run>/{weights|sampler_weights|external_weights}/<name>` (`mint://` accepted, the
  same checkpoint); it names the revision tagged `<segment>.<name>` in policy `<run>`.
* Tinker model id: `<session>:train:<n>`; its run (the store's policy) is `<session>-train-<n>`.
* Served model name (an OpenAI `model`, a vLLM LoRA name): a checkpoint path, `<policy>@<revision>` (a revision
  id or a unique prefix of ≥ 6 hex digits, which must be the policy's), or a catalog reference `<policy>[:<tag>]`.
  A checkpoint path of a policy `dsv4flash serve` did not train (one published by a training run or
  `dsv4flash lifecycle import`) names its tag directly: `tinker://decoder_lora/weights/latest` is
  `decoder_lora:latest`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping

CheckpointType = Literal["training", "sampler", "external"]

SCHEMES = ("tinker://", "mint://")
_PATH = re.compile(r"(tinker|mint)://([^/]+)/(weights|sampler_weights|external_weights)/([^/]+)")
_KIND: dict[str, CheckpointType] = {"weights": "training", "sampler_weights": "sampler",
                                    "external_weights": "external"}
_SEGMENT = {kind: segment for segment, kind in _KIND.items()}
CHECKPOINT_TAG_PREFIXES = tuple(f"{segment}." for segment in _KIND)  # the catalog tags that are checkpoints
_MODEL_ID = re.compile(r"([^:]+):train:(0|[1-9][0-9]*)")
REVISION_SEP = "@"
REVISION_PATTERN = re.compile(r"[0-9a-f]{6,64}")  # a revision id (64 hex) or a prefix of it
# The policy-meta key of the runs `dsv4flash serve` creates; a policy without it was published from outside.
SERVICE_META = "dsv4flash_service"


def split_catalog_ref(ref: str) -> tuple[str, str | None]:
    """`<policy>[:<tag>]` -> (policy, tag); the tag is None when absent or empty (the policy's head)."""
    policy, _, tag = ref.partition(":")
    return policy, tag or None


def has_checkpoint_scheme(name: str) -> bool:
    """Whether `name` is spelled as a checkpoint path (`tinker://…` or `mint://…`), well-formed or not."""
    return name.startswith(SCHEMES)


@dataclass(frozen=True)
class ParsedCheckpointTinkerPath:
    """`tinker://<run>/{weights|sampler_weights|external_weights}/<name>` (or `mint://…`) taken apart."""

    tinker_path: str
    training_run_id: str
    checkpoint_type: CheckpointType
    checkpoint_id: str

    @classmethod
    def from_tinker_path(cls, path: str) -> "ParsedCheckpointTinkerPath":
        """Parse; a clear error says what shape was expected."""
        m = _PATH.fullmatch(path)
        if m is None:
            raise ValueError(f"checkpoint path {path!r}: expected tinker://<run>/weights/<name>, "
                             f"tinker://<run>/sampler_weights/<name> or tinker://<run>/external_weights/<name> "
                             f"(mint:// accepted)")
        return cls(path, m.group(2), _KIND[m.group(3)], m.group(4))

    @classmethod
    def from_tag(cls, run_id: str, tag: str) -> "ParsedCheckpointTinkerPath | None":
        """The checkpoint a catalog tag of run `run_id` stores (`<segment>.<name>`), None for any other tag."""
        segment, _, name = tag.partition(".")
        if segment not in _KIND:
            return None  # a tag set through the lifecycle API, not a Tinker checkpoint
        return cls.from_tinker_path(f"tinker://{run_id}/{segment}/{name}")

    @property
    def canonical(self) -> str:
        """This path spelled `tinker://…`, whatever scheme it came in (the key of per-path state)."""
        # Expiry and the publish flag are keyed by it, so no spelling escapes what another spelling set.
        return f"tinker://{self.training_run_id}/{_SEGMENT[self.checkpoint_type]}/{self.checkpoint_id}"

    @property
    def run_relative(self) -> str:
        """`<segment>/<name>`: the path after the run (Tinker's `checkpoint_id` in listings and deletes)."""
        return f"{_SEGMENT[self.checkpoint_type]}/{self.checkpoint_id}"

    @property
    def tag(self) -> str:
        """The lifecycle catalog tag this checkpoint is stored under."""
        return f"{_SEGMENT[self.checkpoint_type]}.{self.checkpoint_id}"

    @property
    def catalog_ref(self) -> str:
        """`<run>:<tag>`: the catalog reference of the revision this path names."""
        return f"{self.training_run_id}:{self.tag}"


@dataclass(frozen=True)
class ModelId:
    """A Tinker model id `<session>:train:<n>` taken apart."""

    session_id: str
    seq: int

    def __str__(self) -> str:
        return f"{self.session_id}:train:{self.seq}"

    @property
    def run_id(self) -> str:
        """The store's run id (the catalog policy) of this model: `<session>-train-<n>`."""
        return f"{self.session_id}-train-{self.seq}"


def parse_model_id(model_id: str) -> ModelId:
    """Parse a Tinker model id; a clear error says what shape was expected."""
    m = _MODEL_ID.fullmatch(model_id)
    if m is None:
        raise ValueError(f"model id {model_id!r}: expected <session>:train:<n>")
    return ModelId(m.group(1), int(m.group(2)))


def run_id_of(run_or_model_id: str) -> str:
    """The store's run id of a Tinker model id (`<session>:train:<n>` -> `<session>-train-<n>`); a run id as is."""
    try:
        return parse_model_id(run_or_model_id).run_id
    except ValueError:
        return run_or_model_id


def session_of(run_or_model_id: str) -> str | None:
    """The session of a Tinker model id; None for anything else (a run id names no live session)."""
    try:
        return parse_model_id(run_or_model_id).session_id
    except ValueError:
        return None


def is_server_run(policy_meta: Mapping[str, Any]) -> bool:
    """Whether a policy (by its catalog meta) is a run of `dsv4flash serve`, whose checkpoint tags are
    `<segment>.<name>`; any other policy's checkpoints are its tags as they are."""
    return SERVICE_META in policy_meta


def checkpoint_ref(path: ParsedCheckpointTinkerPath, server_run: bool) -> str:
    """The catalog reference a checkpoint path names: `<run>:<segment>.<name>` for a run of the server,
    `<policy>:<name>` for a policy published from outside (`tinker://decoder_lora/weights/latest` is
    `decoder_lora:latest`)."""
    return path.catalog_ref if server_run else f"{path.training_run_id}:{path.checkpoint_id}"


@dataclass(frozen=True)
class ModelName:
    """A served model name taken apart: a checkpoint path, `<policy>@<revision>` or `<policy>[:<tag>]`."""

    name: str
    policy: str
    tag: str | None = None  # None (and no revision, no path): the policy's head
    revision: str | None = None  # a revision id or a unique prefix of it
    path: ParsedCheckpointTinkerPath | None = None


MODEL_NAME_FORMS = ("<policy>:<tag>, <policy>@<revision> (≥ 6 hex digits), <policy> (its head) or "
                    "tinker://<run>/sampler_weights/<name>")


def parse_model_name(name: str) -> ModelName:
    """Parse a served model name; ValueError naming it and the accepted forms otherwise."""
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"model name {name!r}: expected {MODEL_NAME_FORMS}")
    if has_checkpoint_scheme(name):
        path = ParsedCheckpointTinkerPath.from_tinker_path(name)
        return ModelName(name, path.training_run_id, path=path)
    if REVISION_SEP in name:
        policy, _, revision = name.partition(REVISION_SEP)
        if not policy or ":" in policy or not REVISION_PATTERN.fullmatch(revision):
            raise ValueError(f"model name {name!r}: expected <policy>@<revision> with the revision as 6 to 64 "
                             f"lowercase hex digits")
        return ModelName(name, policy, revision=revision)
    policy, tag = split_catalog_ref(name)
    if not policy:
        raise ValueError(f"model name {name!r}: expected {MODEL_NAME_FORMS}")
    return ModelName(name, policy, tag=tag)


def resolve_model_name(catalog, name: str | ModelName):
    """The `RevisionRecord` a served model name names in `catalog` (a lifecycle `Catalog`) now: the one
    resolution of the server's OpenAI routes and the vLLM resolver. Raises ValueError for a malformed name and
    the catalog's RevisionNotFoundError / PolicyNotFoundError when nothing matches."""
    from dsv4flash.lifecycle.errors import RevisionNotFoundError

    parsed = parse_model_name(name) if isinstance(name, str) else name
    if parsed.revision is not None:
        rec = catalog.resolve(parsed.revision)
        if rec.policy != parsed.policy:
            raise RevisionNotFoundError(f"{parsed.name!r}: revision {parsed.revision} is not a revision of policy "
                                        f"{parsed.policy!r}")
        return rec
    if parsed.path is not None:
        server_run = is_server_run(catalog.policy(parsed.policy).meta)
        return catalog.resolve(checkpoint_ref(parsed.path, server_run))
    return catalog.resolve(f"{parsed.policy}:{parsed.tag}" if parsed.tag else parsed.policy)


def lora_int_id(rev_id: str) -> int:
    """vLLM's LoRA int id of a revision: from its id, so one revision is one adapter slot however it is named."""
    return int(rev_id[:7], 16) + 1
