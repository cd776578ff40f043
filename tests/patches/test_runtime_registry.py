"""The runtime-twin registry: gate, version gate, upstream detection, idempotence, revert, dependencies."""

from __future__ import annotations

import importlib
import sys

import pytest

from dsv4flash.patching import twins
from dsv4flash.patching.twins import Outcome
from tests.patches.fake_upstream import FakeProject

pytestmark = pytest.mark.patches


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """fakeup installed (importable, with dist-info) from a temp folder, and a private registry."""
    proj = FakeProject(tmp_path)
    monkeypatch.syspath_prepend(str(proj.twins))
    monkeypatch.setattr(twins, "REGISTRY", twins.Registry())
    yield proj
    for name in [n for n in sys.modules if n.split(".")[0] in ("fake_integrations", "fakeup")]:
        del sys.modules[name]


def _twin(fake: FakeProject, patch_id: str = "FAKE-001", version: str = "1.0", **kwargs):
    fake.install_dist(version)
    importlib.invalidate_caches()
    module = fake.add_twin(patch_id, **kwargs)
    importlib.import_module(module)
    return twins.REGISTRY.get(patch_id)


def test_auto_applies_once_and_revert_restores_the_original(fake):
    twin = _twin(fake)
    import fakeup.core

    original = fakeup.core.answer
    assert twin.apply() is Outcome.APPLIED
    assert fakeup.core.answer() == 42 and getattr(fakeup.core.answer, twins.MARKER) == "FAKE-001"
    assert twin.apply() is Outcome.ALREADY_APPLIED
    twin.revert()
    assert fakeup.core.answer is original and fakeup.core.answer() == 41
    twin.revert()  # no-op


def test_gate_off_on_and_invalid(fake, monkeypatch):
    twin = _twin(fake)
    import fakeup.core

    monkeypatch.setenv("FAKEUP_FAKE_001", "off")
    assert twin.apply() is Outcome.DISABLED and fakeup.core.answer() == 41
    monkeypatch.setenv("FAKEUP_FAKE_001", "maybe")
    with pytest.raises(ValueError, match="FAKEUP_FAKE_001='maybe' .* must be one of auto, on"):
        twin.apply()
    monkeypatch.setenv("FAKEUP_FAKE_001", "1")
    assert twin.apply() is Outcome.APPLIED and fakeup.core.answer() == 42
    twin.revert()


def test_version_gate(fake, monkeypatch):
    twin = _twin(fake, version="2.5")
    import fakeup.core

    assert twin.version_supported() is False
    assert twin.apply() is Outcome.UNSUPPORTED_VERSION and fakeup.core.answer() == 41
    monkeypatch.setenv("FAKEUP_FAKE_001", "on")  # forcing overrides the tested range
    assert twin.apply() is Outcome.APPLIED and fakeup.core.answer() == 42
    twin.revert()


def test_not_installed(fake):
    module = fake.add_twin("FAKE-001")
    importlib.import_module(module)
    assert twins.REGISTRY.get("FAKE-001").apply() is Outcome.NOT_INSTALLED


def test_upstream_probe_skips_the_twin(fake):
    twin = _twin(fake, probe="lambda: __import__('fakeup.core').core.answer() == 42")
    import fakeup.core

    assert twin.upstream_has_it() is False
    fakeup.core.answer = lambda: 42  # "upstream" now has the fix
    twin._upstream_cache = None
    assert twin.apply() is Outcome.UPSTREAM_HAS_IT


def test_probe_measures_upstream_even_while_applied(fake):
    twin = _twin(fake, probe="lambda: __import__('fakeup.core').core.answer() == 42")
    import fakeup.core

    assert twin.apply(mode="on") is Outcome.APPLIED
    assert twin.upstream_has_it() is False  # the twin is suspended for the probe ...
    assert fakeup.core.answer() == 42  # ... and back afterwards
    twin.revert()


def test_probe_whose_import_applies_the_twin_measures_again_without_it(fake):
    # As in production: the probe's first import of upstream fires the plugin's post-import hook, which
    # applies the twin before the probe reads the code (a veRL probe once reported our own fix as upstream's).
    registry = "__import__('dsv4flash.patching.twins', fromlist=['REGISTRY']).REGISTRY"
    hook = (f"(lambda m=__import__('fakeup'): getattr(m, 'hook_fired', False) "
            f"or (setattr(m, 'hook_fired', True), {registry}.get('FAKE-001').apply(mode='on')))")
    twin = _twin(fake, probe=f"lambda: ({hook}(), __import__('fakeup.core').core.answer() == 42)[1]")
    import fakeup.core

    assert not twin.applied
    assert twin.upstream_has_it() is False
    assert twin.applied and fakeup.core.answer() == 42  # the hook's application stays, as it would
    twin.revert()


def test_dependencies_apply_first_and_block_when_off(fake, monkeypatch):
    fake.install_dist()
    importlib.invalidate_caches()
    importlib.import_module(fake.add_twin("FAKE-001"))
    importlib.import_module(fake.add_twin("FAKE-002", returns=43, depends_on=("FAKE-001",)))
    first, second = twins.REGISTRY.get("FAKE-001"), twins.REGISTRY.get("FAKE-002")
    monkeypatch.setenv("FAKEUP_FAKE_001", "off")
    assert second.apply() is Outcome.DEPENDENCY_MISSING and not first.applied
    monkeypatch.delenv("FAKEUP_FAKE_001")
    assert twins.REGISTRY.apply_all(distribution="fakeup") == {
        "FAKE-001": Outcome.APPLIED, "FAKE-002": Outcome.APPLIED}
    second.revert()
    first.revert()


def test_registration_errors(fake):
    importlib.import_module(fake.add_twin("FAKE-001"))
    clash = fake.add_twin("FAKE-001", stem="another_module")
    with pytest.raises(ValueError, match="FAKE-001 is registered by both"):
        importlib.import_module(clash)
    undocumented = fake.add_twin("FAKE-003", docstring=False)
    with pytest.raises(ValueError, match="needs 'Why:' and 'How:'"):
        importlib.import_module(undocumented)
    with pytest.raises(twins.UnknownPatch, match="no runtime twin registered for Patch-Id NOPE"):
        twins.REGISTRY.get("NOPE")


def test_reload_keeps_the_applied_state(fake):
    twin = _twin(fake)
    import fakeup.core

    assert twin.apply() is Outcome.APPLIED
    reloaded = importlib.reload(sys.modules["fake_integrations.fakeup.patches.fake_001"])
    again = twins.REGISTRY.get("FAKE-001")
    assert again is not twin and again.applied and reloaded.install is again
    assert again.apply() is Outcome.ALREADY_APPLIED
    again.revert()
    assert fakeup.core.answer() == 41


def test_revert_and_suspend_take_stacked_dependents_along(fake):
    base = _twin(fake, "FAKE-001")
    top = _twin(fake, "FAKE-002", returns=43, depends_on=("FAKE-001",))
    import fakeup.core

    original = fakeup.core.answer
    assert top.apply() is Outcome.APPLIED and base.applied and fakeup.core.answer() == 43  # same attribute twice
    with base.suspended():
        assert fakeup.core.answer is original and not top.applied
    assert base.applied and top.applied and fakeup.core.answer() == 43
    base.revert()
    assert not top.applied and fakeup.core.answer is original


def test_provide_module_adds_and_removes_a_new_upstream_module(fake):
    import types

    _twin(fake)
    import fakeup

    patcher = twins.Patcher("FAKE-001")
    extra = types.ModuleType("fakeup.extra")
    extra.value = 7
    patcher.provide_module("fakeup.extra", extra)
    patcher.provide_module("fakeup.extra", extra)  # idempotent
    from fakeup.extra import value

    assert value == 7 and fakeup.extra is extra
    with pytest.raises(AttributeError, match="fakeup.core already exists in the installed upstream"):
        patcher.provide_module("fakeup.core", types.ModuleType("fakeup.core"))
    patcher.undo()
    assert "fakeup.extra" not in sys.modules and not hasattr(fakeup, "extra")
    with pytest.raises(ImportError):
        importlib.import_module("fakeup.extra")


def test_obsolete_evaluates_remove_when(fake):
    twin = _twin(fake)
    assert twin.obsolete() is False  # fakeup 1.0 installed, Remove-When fakeup>=2.0
    assert twin.obsolete({"fakeup": "2.0"}) is True


@pytest.mark.upstream
def test_real_mcore_twin_via_register(monkeypatch):
    from megatron.core.transformer.moe.router import TopKRouter

    import dsv4flash.integrations.mcore as mcore

    twin = twins.discover().get("DSV41-MCORE-001")
    with twin.suspended():
        stock = TopKRouter.__dict__["_apply_expert_bias"]
        assert twin.upstream_has_it() is False, "megatron-core 0.19.2 has the bug; the probe must see it"
        monkeypatch.setenv("DSV4FLASH_MCORE_EXPERT_BIAS_PADDING", "off")
        assert mcore.register()["DSV41-MCORE-001"] is Outcome.DISABLED
        assert TopKRouter.__dict__["_apply_expert_bias"] is stock
        monkeypatch.delenv("DSV4FLASH_MCORE_EXPERT_BIAS_PADDING")
        outcomes = mcore.register()
        assert outcomes["DSV41-MCORE-001"] is Outcome.APPLIED
        # DSV41-MCORE-004 (Depends-On 001) stacks its per-modality count on top of 001's row fix.
        assert getattr(TopKRouter.__dict__["_apply_expert_bias"], twins.MARKER) == "DSV41-MCORE-004"
        assert mcore.register()["DSV41-MCORE-001"] is Outcome.ALREADY_APPLIED
        twin.revert()  # dependents first, so nothing stays stacked on a reverted twin
        assert TopKRouter.__dict__["_apply_expert_bias"] is stock
        assert not any(twins.REGISTRY.get(pid).applied for pid in ("DSV41-MCORE-003", "DSV41-MCORE-004"))
        for pid in outcomes:
            twins.REGISTRY.get(pid).revert()


PATCH_ID = "DSV41-MCORE-004"  # the both-forms harness test below: a twin with two Depends-On


def test_patch_form_reverts_the_dependencies_it_applied(patch_form, mcore_parallel):
    registry = twins.discover()
    if patch_form.name == "runtime":
        assert all(registry.get(pid).applied for pid in ("DSV41-MCORE-001", "DSV41-MCORE-003", PATCH_ID))
    patch_form.record("form_ran", True)


def _applied_by_verl_plugin() -> set[str]:
    """veRL twins that the `verl.plugins` entry point applied when a test imported the veRL module they patch."""
    from dsv4flash.integrations import verl as verl_plugin

    return {pid for pid, outcome in verl_plugin.OUTCOMES.items()
            if outcome is Outcome.APPLIED and verl_plugin.TRIGGERS[pid] in sys.modules}


def _applied_for_the_csa2_stack() -> set[str]:
    """Twins whose upstream-form modules the imported CSA2 stack is built from (and their Depends-On)."""
    if "dsv4flash.integrations.mcore.csa2" not in sys.modules:
        return set()
    from dsv4flash.integrations.mcore import STACK_TWINS

    return twins.discover().with_dependencies(STACK_TWINS)


def test_no_twin_is_left_applied_after_a_both_forms_test():
    """The harness reverts what a `[runtime]` test applied; only the installed veRL plugin's twins may stay.

    Applying a veRL twin when its veRL module is imported is the plugin's documented behaviour (docs/verl.md,
    "What the plugin changes"): an earlier test in this process that imports, e.g., `verl.workers.config`
    applies DSV41-VERL-010/011 and they stay, as they would in a veRL worker. Those are not a leak; nor are the
    twins an imported CSA2 stack applied for its upstream-form modules (`mcore.require_stack_modules`).
    """
    from dsv4flash.integrations import mbridge

    # and `mbridge.register()`'s, which veRL's bridge import runs through the plugin
    plugin = _applied_by_verl_plugin() | _applied_for_the_csa2_stack() | mbridge.REGISTERED
    assert [t.meta.patch_id for t in twins.discover().all() if t.applied and t.meta.patch_id not in plugin] == []


def test_patcher_add_creates_a_new_name_and_undo_removes_it():
    import types

    owner = types.SimpleNamespace(existing=1)
    patcher = twins.Patcher("FAKE-ADD")

    def helper():
        return "new"

    patcher.add(owner, "helper", helper)
    patcher.add(owner, "helper", helper)  # this patch's own: idempotent
    assert owner.helper() == "new" and len(patcher.replaced) == 1
    with pytest.raises(AttributeError, match="FAKE-ADD: .*existing already exists"):
        patcher.add(owner, "existing", helper)
    patcher.undo()
    assert not hasattr(owner, "helper") and owner.existing == 1
