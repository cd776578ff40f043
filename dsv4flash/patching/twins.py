"""Runtime twins: upstream fixes applied to an installed upstream package at run time, one registry for all.

Every upstream change ships twice under one Patch-Id (docs/patches.md): a format-patch in `patches/<upstream>/`
and a runtime twin in `dsv4flash/integrations/<target>/patches/`. A twin module declares itself with

    @runtime_patch(patch_id="DSV41-MCORE-001", target="NVIDIA/Megatron-LM", distribution="megatron-core",
                   versions=">=0.19,<0.20", touches=(...), upstream_status="...", forwarded="...",
                   remove_when="megatron-core>=0.20.0", gate="DSV4FLASH_...", tests=(...),
                   upstream_has_it=probe)
    def install(patcher): patcher.replace(SomeClass, "method", fixed_method)

and gets the same metadata keys as the format-patch trailers (Why/How come from the module docstring), so
`dsv4flash patches check` can compare the two forms. Applying is idempotent and revertable, gated by an
environment variable (`auto` = on iff the installed release is supported and lacks the fix; `on`; `off`),
and skipped when a behavioural probe finds the fix already upstream. Importing a twin module never imports
the upstream package; only `apply()` and the probe do.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.util
import inspect
import logging
import os
import pkgutil
import re
import sys
import threading
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dsv4flash.patching import predicate

log = logging.getLogger("dsv4flash.patches")

MARKER = "__dsv4flash_patch__"
GATE_ON = ("1", "on", "true", "yes", "force")
GATE_OFF = ("0", "off", "false", "no")
GATE_AUTO = ("", "auto")
TWIN_PACKAGE_ROOT = "dsv4flash.integrations"


class UnknownPatch(KeyError):
    """No runtime twin is registered under the requested Patch-Id."""

    def __str__(self) -> str:
        return str(self.args[0])


class Outcome(str, enum.Enum):
    """What `RuntimePatch.apply` did."""

    APPLIED = "applied"
    ALREADY_APPLIED = "already-applied"
    UPSTREAM_HAS_IT = "upstream-has-it"
    DISABLED = "disabled"
    UNSUPPORTED_VERSION = "unsupported-version"
    NOT_INSTALLED = "not-installed"
    DEPENDENCY_MISSING = "dependency-missing"

    @property
    def active(self) -> bool:
        """Whether the patched behaviour is in effect after this outcome."""
        return self in (Outcome.APPLIED, Outcome.ALREADY_APPLIED, Outcome.UPSTREAM_HAS_IT)


@dataclass(frozen=True)
class TwinMeta:
    """The trailer keys a runtime twin carries (mirrors the format-patch of the same Patch-Id)."""

    patch_id: str
    target: str
    distribution: str
    versions: str
    touches: tuple[str, ...]
    upstream_status: str
    forwarded: str
    remove_when: str
    gate: str
    tests: tuple[str, ...]
    depends_on: tuple[str, ...] = ()
    module: str = ""
    summary: str = ""
    why: str = ""
    how: str = ""


@dataclass
class _Replacement:
    owner: Any
    name: str
    original: Any
    had_own: bool


@dataclass
class Patcher:
    """Passed to a twin's install function; records each attribute it replaces so the twin can be reverted."""

    patch_id: str
    replaced: list[_Replacement] = field(default_factory=list)
    provided: list[str] = field(default_factory=list)

    def replace(self, owner: Any, name: str, value: Any) -> None:
        """Set `owner.name = value` (value is tagged with the Patch-Id); no-op if already this patch's."""
        try:
            current = inspect.getattr_static(owner, name)
        except AttributeError:
            raise AttributeError(f"{self.patch_id}: {getattr(owner, '__name__', owner)}.{name} does not exist in "
                                 "the installed upstream (renamed or removed?); see the twin's Remove-When") from None
        if getattr(current, MARKER, None) == self.patch_id:
            return
        had_own = name in getattr(owner, "__dict__", {})
        try:
            setattr(value, MARKER, self.patch_id)
        except AttributeError as exc:
            raise TypeError(f"{self.patch_id}: replacement for {name} cannot carry the patch marker") from exc
        self.replaced.append(_Replacement(owner, name, current if had_own else None, had_own))
        setattr(owner, name, value)

    def provide_module(self, name: str, module: Any) -> None:
        """Make `import name` return `module`: a module the format-patch adds upstream; `undo` removes it."""
        current = sys.modules.get(name)
        if current is not None and getattr(current, MARKER, None) == self.patch_id:
            return
        parent, _, leaf = name.rpartition(".")
        package = importlib.import_module(parent)
        if current is not None or importlib.util.find_spec(name) is not None:
            raise AttributeError(f"{self.patch_id}: {name} already exists in the installed upstream; the twin "
                                 "would shadow it (see the twin's Remove-When)")
        setattr(module, MARKER, self.patch_id)
        sys.modules[name] = module
        self.provided.append(name)
        self.add(package, leaf, module)

    def add(self, owner: Any, name: str, value: Any) -> None:
        """Set `owner.name = value` for a name upstream lacks (a new public helper); no-op if already this patch's."""
        current = getattr(owner, name, None)
        if getattr(current, MARKER, None) == self.patch_id:
            return
        if hasattr(owner, name):
            raise AttributeError(f"{self.patch_id}: {getattr(owner, '__name__', owner)}.{name} already exists in the "
                                 "installed upstream; the twin must not shadow it (see its probe and Remove-When)")
        try:
            setattr(value, MARKER, self.patch_id)
        except AttributeError as exc:
            raise TypeError(f"{self.patch_id}: addition {name} cannot carry the patch marker") from exc
        self.replaced.append(_Replacement(owner, name, None, False))
        setattr(owner, name, value)

    def undo(self) -> None:
        """Restore every replaced attribute and drop every provided module, newest first."""
        while self.replaced:
            rep = self.replaced.pop()
            if rep.had_own:
                setattr(rep.owner, rep.name, rep.original)
            else:
                delattr(rep.owner, rep.name)
        while self.provided:
            sys.modules.pop(self.provided.pop(), None)


class RuntimePatch:
    """A registered runtime twin: metadata, install function, optional upstream probe, applied state."""

    def __init__(self, meta: TwinMeta, install: Callable[[Patcher], None], probe: Callable[[], bool] | None):
        self.meta = meta
        self._install = install
        self._probe = probe
        self._patcher: Patcher | None = None
        self._upstream_cache: bool | None = None
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"RuntimePatch({self.meta.patch_id}, {self.meta.module}, applied={self.applied})"

    def __call__(self, mode: str | None = None) -> Outcome:
        """Same as `apply`."""
        return self.apply(mode)

    @property
    def has_probe(self) -> bool:
        """Whether the twin can detect the fix in upstream code by behaviour (not just by version)."""
        return self._probe is not None

    @property
    def applied(self) -> bool:
        """Whether this process currently runs with the twin installed."""
        return self._patcher is not None

    def installed_version(self) -> str | None:
        """Version of the target distribution installed here, or None."""
        try:
            return metadata.version(self.meta.distribution)
        except metadata.PackageNotFoundError:
            return None

    def version_supported(self, version: str | None = None) -> bool | None:
        """Whether `version` (default: installed) is in the twin's declared `versions` range."""
        version = version if version is not None else self.installed_version()
        if version is None:
            return None
        return SpecifierSet(self.meta.versions).contains(Version(version), prereleases=True)

    def gate_mode(self) -> str:
        """'auto', 'on' or 'off' from the gate environment variable; raises on anything else."""
        raw = os.environ.get(self.meta.gate, "").strip().lower()
        if raw in GATE_AUTO:
            return "auto"
        if raw in GATE_ON:
            return "on"
        if raw in GATE_OFF:
            return "off"
        raise ValueError(
            f"{self.meta.gate}={os.environ[self.meta.gate]!r} (gate of {self.meta.patch_id}) must be one of "
            f"auto, on ({'/'.join(GATE_ON)}) or off ({'/'.join(GATE_OFF)})"
        )

    def upstream_has_it(self) -> bool | None:
        """Run the behavioural probe against the unpatched upstream (cached); None if not installed/no probe."""
        with self._lock:
            if self._upstream_cache is not None:
                return self._upstream_cache
            if self._probe is None or self.installed_version() is None:
                return None
            if self.applied:
                # The probe must see upstream code, not ours: take the twin out for the measurement.
                with self.suspended():
                    self._upstream_cache = bool(self._probe())
            else:
                result = bool(self._probe())
                if self.applied:
                    # The probe's own imports fired the lazy post-import hooks and applied this twin, so it
                    # may have measured our code: measure again with the twin taken out.
                    with self.suspended():
                        result = bool(self._probe())
                self._upstream_cache = result
            return self._upstream_cache

    def obsolete(self, versions: dict[str, str | None] | None = None) -> bool | None:
        """Evaluate Remove-When against `versions` (default: installed); None when undecidable."""
        return predicate.parse(self.meta.remove_when).evaluate(versions)

    def apply(self, mode: str | None = None, registry: "Registry | None" = None) -> Outcome:
        """Install the twin if the gate, version range and upstream probe call for it (idempotent)."""
        with self._lock:
            mode = mode or self.gate_mode()
            if mode not in ("auto", "on", "off"):
                raise ValueError(f"{self.meta.patch_id}: apply mode must be auto, on or off, got {mode!r}")
            if self.applied:
                return Outcome.ALREADY_APPLIED
            if mode == "off":
                return Outcome.DISABLED
            version = self.installed_version()
            if version is None:
                return Outcome.NOT_INSTALLED
            if mode == "auto":
                if not self.version_supported(version):
                    log.warning(
                        "%s not applied: %s %s is outside its tested range %s (set %s=on to force)",
                        self.meta.patch_id, self.meta.distribution, version, self.meta.versions, self.meta.gate,
                    )
                    return Outcome.UNSUPPORTED_VERSION
                if self.upstream_has_it():
                    log.info("%s not needed: %s %s already has the fix", self.meta.patch_id,
                             self.meta.distribution, version)
                    return Outcome.UPSTREAM_HAS_IT
            registry = registry or REGISTRY
            for dep in self.meta.depends_on:
                if not registry.get(dep).apply(registry=registry).active:
                    log.warning("%s not applied: it depends on %s, which is not active", self.meta.patch_id, dep)
                    return Outcome.DEPENDENCY_MISSING
            patcher = Patcher(self.meta.patch_id)
            try:
                self._install(patcher)
            except Exception:
                patcher.undo()
                raise
            self._patcher = patcher
            log.info("%s applied to %s %s", self.meta.patch_id, self.meta.distribution, version)
            return Outcome.APPLIED

    def applied_dependents(self) -> list["RuntimePatch"]:
        """Applied twins of the registry whose Depends-On names this one (they may stack on its replacements)."""
        return [t for t in REGISTRY.all() if self.meta.patch_id in t.meta.depends_on and t.applied]

    def revert(self) -> None:
        """Uninstall the twin (no-op if not applied); applied dependents are reverted first.

        A dependent may replace the same attribute again on top of this twin's replacement; undoing this
        one first would put the stock attribute back under a dependent that still counts as applied.
        """
        with self._lock:
            for dependent in self.applied_dependents():
                dependent.revert()
            if self._patcher is not None:
                self._patcher.undo()
                self._patcher = None

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Run a block against stock upstream: revert if applied (dependents too), re-apply all afterwards."""
        with self._lock:
            was_applied = self.applied
            dependents = self.applied_dependents()
            self.revert()
            try:
                yield
            finally:
                if was_applied:
                    self.apply(mode="on")
                for dependent in dependents:
                    dependent.apply(mode="on")


class Registry:
    """Patch-Id -> RuntimePatch. The module-level `REGISTRY` is the one `dsv4flash patches` reads."""

    def __init__(self) -> None:
        self._patches: dict[str, RuntimePatch] = {}

    def register(self, patch: RuntimePatch) -> RuntimePatch:
        """Add a twin; re-registering from the same module (a reload) keeps the applied state."""
        old = self._patches.get(patch.meta.patch_id)
        if old is not None:
            if old.meta.module != patch.meta.module:
                raise ValueError(
                    f"Patch-Id {patch.meta.patch_id} is registered by both {old.meta.module} and {patch.meta.module}"
                )
            patch._patcher, patch._upstream_cache = old._patcher, old._upstream_cache
        self._patches[patch.meta.patch_id] = patch
        return patch

    def get(self, patch_id: str) -> RuntimePatch:
        """The twin with this Patch-Id; KeyError names the known ones."""
        try:
            return self._patches[patch_id]
        except KeyError:
            known = ", ".join(sorted(self._patches)) or "none"
            raise UnknownPatch(f"no runtime twin registered for Patch-Id {patch_id} (registered: {known})") from None

    def __contains__(self, patch_id: str) -> bool:
        return patch_id in self._patches

    def all(self) -> list[RuntimePatch]:
        """Every registered twin, sorted by Patch-Id."""
        return [self._patches[k] for k in sorted(self._patches)]

    def with_dependencies(self, patch_ids) -> set[str]:
        """`patch_ids` and everything they depend on (Depends-On, transitively)."""
        out: set[str] = set()
        todo = list(patch_ids)
        while todo:
            patch_id = todo.pop()
            if patch_id not in out:
                out.add(patch_id)
                todo.extend(self.get(patch_id).meta.depends_on)
        return out

    def apply_all(self, distribution: str | None = None, mode: str | None = None) -> dict[str, Outcome]:
        """Apply every twin (optionally only those for one distribution); returns Patch-Id -> Outcome."""
        return {
            p.meta.patch_id: p.apply(mode, registry=self)
            for p in self.all()
            if distribution is None or p.meta.distribution == distribution
        }


REGISTRY = Registry()


def _docstring_section(doc: str, key: str) -> str:
    """The paragraph(s) after `key:` in a docstring, up to the next `Word:` heading or the end."""
    match = re.search(rf"^{key}:\s*(.*?)(?=^\w[\w-]*:\s|\Z)", doc, flags=re.S | re.M)
    return " ".join(match.group(1).split()) if match else ""


def runtime_patch(
    *,
    patch_id: str,
    target: str,
    distribution: str,
    versions: str,
    touches: tuple[str, ...] | list[str],
    upstream_status: str,
    forwarded: str,
    remove_when: str,
    gate: str,
    tests: tuple[str, ...] | list[str],
    depends_on: tuple[str, ...] | list[str] = (),
    upstream_has_it: Callable[[], bool] | None = None,
) -> Callable[[Callable[[Patcher], None]], RuntimePatch]:
    """Decorator turning `install(patcher)` into a registered RuntimePatch with trailer-equivalent metadata."""
    predicate.parse(remove_when)  # fail at import time, not in CI
    SpecifierSet(versions)

    def decorate(install: Callable[[Patcher], None]) -> RuntimePatch:
        module = install.__module__
        doc = inspect.getdoc(sys.modules.get(module)) or ""
        meta = TwinMeta(
            patch_id=patch_id, target=target, distribution=distribution, versions=versions,
            touches=tuple(touches), upstream_status=upstream_status, forwarded=forwarded,
            remove_when=remove_when, gate=gate, tests=tuple(tests), depends_on=tuple(depends_on),
            module=module, summary=doc.splitlines()[0] if doc else "",
            why=_docstring_section(doc, "Why"), how=_docstring_section(doc, "How"),
        )
        if not meta.why or not meta.how:
            raise ValueError(f"runtime twin {module} ({patch_id}) needs 'Why:' and 'How:' in its module docstring")
        return REGISTRY.register(RuntimePatch(meta, install, upstream_has_it))

    return decorate


def discover(root_package: str = TWIN_PACKAGE_ROOT) -> Registry:
    """Import every module under `<root_package>.*.patches` so all twins are registered; returns REGISTRY."""
    root = importlib.import_module(root_package)
    for integration in pkgutil.iter_modules(root.__path__):
        # Only integrations that have twins: importing another one (e.g. `cookbook`, whose package imports
        # tinker-cookbook) would make every registration need that integration's third-party stack.
        if not integration.ispkg or not (Path(integration.module_finder.path) / integration.name / "patches").is_dir():
            continue
        name = f"{root_package}.{integration.name}.patches"
        try:
            package = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        for mod in pkgutil.iter_modules(package.__path__):
            if not mod.name.startswith("_"):
                importlib.import_module(f"{name}.{mod.name}")
    return REGISTRY
