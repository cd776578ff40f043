"""Model names of the OpenAI routes for one tenant: which revision a `model` names, and what `/v1/models` lists.

Names follow the one grammar of `dsv4flash.lifecycle.refs` (`parse_model_name` / `resolve_model_name`, shared with
the vLLM resolver); the base answers to its short name and to its served directory. The tenant rules are the
Tinker routes': a tenant reads its own runs, every policy published into the store from outside the server, and
another tenant's checkpoints only once published (by the checkpoint's name, or as `<run>@<its revision>`; never
through the run's head or other tags). Anything else is answered exactly like a name that does not
exist (`NotFound`, naming nothing about it).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4flash.lifecycle.refs import ParsedCheckpointTinkerPath, parse_model_name, resolve_model_name
from dsv4flash.service.plane.policy_server import BadRequest, NotFound


@dataclass(frozen=True)
class ServedModel:
    """A resolved `model`: the name as sent and the catalog revision it names now (None: the bare base)."""

    name: str
    revision: str | None


def base_names(plane) -> set[str]:
    """The names the resident base answers to."""
    return {plane.service.base.base_model, plane.served_base_name}


def resolve(plane, tenant: str, name) -> ServedModel:
    """The revision `name` names for `tenant` (BadRequest naming `model` when malformed; NotFound when the tenant
    may not read it or it does not exist)."""
    if not isinstance(name, str):
        raise BadRequest(f"model: expected a string, got {type(name).__name__}")
    if name in base_names(plane):
        return ServedModel(name, None)
    try:
        parsed = parse_model_name(name)
    except ValueError as exc:
        raise BadRequest(f"model: {exc}") from exc
    service = plane.service
    owner = plane.owners.owner(parsed.policy)
    readable = owner == tenant or (owner is None and service.is_trained_policy(parsed.policy))
    try:
        rec = resolve_model_name(service.store.catalog, parsed)
    except (LookupError, ValueError, RuntimeError) as exc:  # the catalog's not-found errors, a bad path
        if readable:
            raise NotFound(f"model {name!r} not found ({exc})") from exc
        raise NotFound(f"model {name!r} not found") from exc
    checkpoint = _checkpoint_of(parsed)
    if checkpoint is not None and service.checkpoints.is_expired(checkpoint):
        raise NotFound(f"model {name!r} not found" + (" (its checkpoint expired)" if readable else ""))
    if not readable:  # another tenant's: only a published checkpoint, by its name or its revision
        published = (service.checkpoints.get(checkpoint)["public"] if checkpoint is not None
                     else parsed.revision is not None and rec.id in _published_revisions(plane, parsed.policy))
        if not published:
            raise NotFound(f"model {name!r} not found")
    return ServedModel(name, rec.id)


def _checkpoint_of(parsed) -> str | None:
    """The checkpoint path a name spells, if any (a path, or a `<run>:<segment>.<name>` tag)."""
    if parsed.path is not None:
        return parsed.path.canonical
    if parsed.tag is not None:
        try:
            path = ParsedCheckpointTinkerPath.from_tag(parsed.policy, parsed.tag)
        except ValueError:
            return None
        return None if path is None else path.canonical
    return None


def _published_revisions(plane, policy: str) -> set[str]:
    """Revision ids of the published, unexpired checkpoints of one policy."""
    out = set()
    for path in plane.service.checkpoints.published():
        if ParsedCheckpointTinkerPath.from_tinker_path(path).training_run_id == policy:
            try:
                out.add(plane.service.require_checkpoint(path).id)
            except FileNotFoundError:
                pass  # deleted or expired since it was published
    return out


def listing(plane, tenant: str) -> list[dict]:
    """`/v1/models` entries for `tenant`: the base, the checkpoints of its runs, policies published from outside
    the server (head and tags), and other tenants' published checkpoints; each `{id, owned_by, root, created}`
    with `root` the revision id."""
    service = plane.service
    catalog = service.store.catalog
    base = service.base.base_model
    out = [{"id": base, "owned_by": "dsv4flash", "root": None, "created": 0}]
    seen = {base}

    def add(name: str, owned_by: str, rev) -> None:
        if name not in seen:
            seen.add(name)
            out.append({"id": name, "owned_by": owned_by, "root": rev.id, "created": int(rev.created)})

    policies = catalog.list_policies()
    for policy in sorted(policies):
        owner = plane.owners.owner(policy)
        if owner == tenant:
            for tag, rev_id in sorted(catalog.tags(policy).items()):
                path = ParsedCheckpointTinkerPath.from_tag(policy, tag) if "/" not in tag else None
                if path is not None and not service.checkpoints.is_expired(path.canonical):
                    add(f"{policy}:{tag}", tenant, catalog.lookup(rev_id))
        elif owner is None and service.is_trained_policy(policy):
            try:
                add(policy, "store", catalog.resolve(policy))
            except LookupError:
                continue  # a policy with no revision yet
            for tag, rev_id in sorted(catalog.tags(policy).items()):
                add(f"{policy}:{tag}", "store", catalog.lookup(rev_id))
    for path in service.checkpoints.published():
        parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
        if plane.owners.owner(parsed.training_run_id) in (None, tenant):
            continue  # the tenant's own are listed above
        try:
            rev = service.require_checkpoint(path)
        except FileNotFoundError:
            continue
        add(parsed.catalog_ref, "published", rev)
    return out
