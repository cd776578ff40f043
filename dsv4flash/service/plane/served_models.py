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

from dsv4flash.lifecycle.refs import (ParsedCheckpointTinkerPath, parse_model_name, resolve_model_name,
                                      split_catalog_ref)
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


def _published_by_run(plane) -> dict[str, list[str]]:
    """The published checkpoint paths (canonical), grouped by their training run."""
    out: dict[str, list[str]] = {}
    for path in plane.service.checkpoints.published():
        out.setdefault(ParsedCheckpointTinkerPath.from_tinker_path(path).training_run_id, []).append(path)
    return out


def _published_revisions(plane, policy: str) -> set[str]:
    """Revision ids of the published, unexpired checkpoints of one policy."""
    out = set()
    for path in _published_by_run(plane).get(policy, ()):
        try:
            out.add(plane.service.require_checkpoint(path).id)
        except FileNotFoundError:
            pass  # deleted or expired since it was published
    return out


_POLICY_PAGE = 256  # catalog rows read per query while a listing page fills


def listing(plane, tenant: str, *, after: str | None = None, limit: int | None = None) -> tuple[list[dict], bool]:
    """`/v1/models` entries for `tenant` -> (entries, has_more); each `{id, owned_by, root, created}` with `root`
    the revision id: the base first, then policy by policy in catalog order (each one's ids sorted) the
    checkpoints of the tenant's runs, policies published from outside the server (head and tags), and other
    tenants' published checkpoints. `after` (an id of an earlier page) and `limit` page through the catalog by
    key, so a page costs its own rows, not the catalog's 10^6."""
    service = plane.service
    catalog = service.store.catalog
    base = service.base.base_model
    published = _published_by_run(plane)
    out: list[dict] = []
    full = (lambda: False) if limit is None else (lambda: len(out) > limit)  # one more row tells has_more
    if after is None:
        out.append({"id": base, "owned_by": "dsv4flash", "root": None, "created": 0})
    cursor = None if after in (None, base) else split_catalog_ref(after)[0]
    if cursor is not None:  # the rest of the cursor's own policy, then the policies after it
        out.extend(e for e in _entries_of(plane, tenant, cursor, published) if e["id"] > after)
    while not full():
        page = catalog.list_policies(after=cursor, limit=_POLICY_PAGE)
        for policy in page:
            out.extend(e for e in _entries_of(plane, tenant, policy, published) if e["id"] != base)
            if full():
                break
        if len(page) < _POLICY_PAGE:
            break
        cursor = page[-1]
    if limit is not None and len(out) > limit:
        return out[:limit], True
    return out, False


def _entries_of(plane, tenant: str, policy: str, published: dict[str, list[str]]) -> list[dict]:
    """One policy's `/v1/models` entries for `tenant`, sorted by id (none for a policy the tenant may not read)."""
    service = plane.service
    catalog = service.store.catalog
    rows: dict[str, dict] = {}

    def add(name: str, owned_by: str, rev) -> None:
        rows.setdefault(name, {"id": name, "owned_by": owned_by, "root": rev.id, "created": int(rev.created)})

    owner = plane.owners.owner(policy)
    try:
        if owner == tenant:
            for tag, rev_id in catalog.tags(policy).items():
                path = ParsedCheckpointTinkerPath.from_tag(policy, tag) if "/" not in tag else None
                if path is not None and not service.checkpoints.is_expired(path.canonical):
                    add(f"{policy}:{tag}", tenant, catalog.lookup(rev_id))
        elif owner is None:
            if service.is_trained_policy(policy):
                add(policy, "store", catalog.resolve(policy))
                for tag, rev_id in catalog.tags(policy).items():
                    add(f"{policy}:{tag}", "store", catalog.lookup(rev_id))
        else:
            for path in published.get(policy, ()):
                try:
                    add(ParsedCheckpointTinkerPath.from_tinker_path(path).catalog_ref, "published",
                        service.require_checkpoint(path))
                except FileNotFoundError:
                    continue  # deleted or expired since it was published
    except LookupError:
        pass  # removed since the page was read, or a policy with no revision yet
    return [rows[name] for name in sorted(rows)]
