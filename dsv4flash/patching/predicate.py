"""`Remove-When` predicates: version conditions on installed distributions, checkable by CI.

Grammar: clauses joined by ` or ` / ` and ` (`and` binds tighter, no parentheses). A clause is a PEP 508
requirement without extras or markers, e.g. `megatron-core>=0.20.0` or `vllm>=0.34,<0.40`. Evaluation is
three-valued: True / False, or None when a named distribution is not installed (Kleene logic combines them).
Pre-releases count (`0.20.0rc1` satisfies `>=0.20.0rc0`), since a release candidate already carries the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata
from typing import Mapping

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version


class PredicateError(ValueError):
    """A Remove-When text that is not a checkable predicate."""


@dataclass(frozen=True)
class Clause:
    """One `name<specifier>` condition."""

    distribution: str
    specifier: str

    def evaluate(self, versions: Mapping[str, str | None]) -> bool | None:
        """True/False against the version of `distribution` in `versions`; None if it is absent."""
        version = versions.get(canonicalize_name(self.distribution))
        if version is None:
            return None
        try:
            parsed = Version(version)
        except InvalidVersion as exc:
            raise PredicateError(f"installed {self.distribution} has an unparseable version {version!r}") from exc
        return Requirement(f"{self.distribution}{self.specifier}").specifier.contains(parsed, prereleases=True)


@dataclass(frozen=True)
class Predicate:
    """A disjunction of conjunctions of clauses, parsed from Remove-When text."""

    text: str
    terms: tuple[tuple[Clause, ...], ...]

    @property
    def distributions(self) -> tuple[str, ...]:
        """Every distribution the predicate mentions, in order of first appearance."""
        seen: dict[str, None] = {}
        for term in self.terms:
            for clause in term:
                seen.setdefault(clause.distribution, None)
        return tuple(seen)

    def evaluate(self, versions: Mapping[str, str | None] | None = None) -> bool | None:
        """Evaluate against `versions` (canonical name -> version), defaulting to what is installed."""
        if versions is None:
            versions = installed_versions(self.distributions)
        else:
            versions = {canonicalize_name(k): v for k, v in versions.items()}
        result: bool | None = False
        for term in self.terms:
            term_value: bool | None = True
            for clause in term:
                term_value = _and(term_value, clause.evaluate(versions))
            result = _or(result, term_value)
        return result


def _and(a: bool | None, b: bool | None) -> bool | None:
    """Kleene AND."""
    if a is False or b is False:
        return False
    return None if a is None or b is None else True


def _or(a: bool | None, b: bool | None) -> bool | None:
    """Kleene OR."""
    if a is True or b is True:
        return True
    return None if a is None or b is None else False


def _parse_clause(text: str, whole: str) -> Clause:
    """Parse one requirement clause, insisting on a version specifier and nothing else."""
    try:
        req = Requirement(text)
    except InvalidRequirement as exc:
        raise PredicateError(f"Remove-When {whole!r}: {text!r} is not a version condition ({exc})") from exc
    if req.extras or req.marker or req.url or not str(req.specifier):
        raise PredicateError(
            f"Remove-When {whole!r}: {text!r} must be '<distribution><op><version>', e.g. 'megatron-core>=0.20.0'"
        )
    return Clause(req.name, str(req.specifier))


def parse(text: str) -> Predicate:
    """Parse Remove-When text into a Predicate, raising PredicateError with the offending part."""
    stripped = " ".join(text.split())
    if not stripped:
        raise PredicateError("Remove-When is empty")
    terms = []
    for disjunct in re.split(r"\s+or\s+", stripped):
        clauses = tuple(_parse_clause(part.strip(), stripped) for part in re.split(r"\s+and\s+", disjunct))
        terms.append(clauses)
    return Predicate(stripped, tuple(terms))


def installed_versions(distributions: tuple[str, ...] | list[str]) -> dict[str, str | None]:
    """Installed version of each distribution (canonical name -> version, or None if not installed)."""
    out: dict[str, str | None] = {}
    for name in distributions:
        try:
            out[canonicalize_name(name)] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[canonicalize_name(name)] = None
    return out
