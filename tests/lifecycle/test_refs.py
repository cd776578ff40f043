"""The revision-name grammar (`dsv4flash.lifecycle.refs`): round trips, and every refused form refused."""

from __future__ import annotations

import pytest
import tinker

from dsv4flash.lifecycle.refs import (SERVICE_META, ModelId, ModelName, ParsedCheckpointTinkerPath, checkpoint_ref,
                                      has_checkpoint_scheme, lora_int_id, parse_model_id, parse_model_name,
                                      resolve_model_name, run_id_of, session_of, split_catalog_ref)

SEGMENTS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


@pytest.mark.parametrize("segment", sorted(SEGMENTS))
@pytest.mark.parametrize("scheme", ["tinker", "mint"])
def test_checkpoint_path_round_trips(scheme, segment):
    path = f"{scheme}://s0a1-train-2/{segment}/step-3:a.b"
    p = ParsedCheckpointTinkerPath.from_tinker_path(path)
    assert (p.tinker_path, p.training_run_id, p.checkpoint_type, p.checkpoint_id) == (
        path, "s0a1-train-2", SEGMENTS[segment], "step-3:a.b")
    assert p.canonical == f"tinker://s0a1-train-2/{segment}/step-3:a.b"
    assert p.tag == f"{segment}.step-3:a.b" and p.run_relative == f"{segment}/step-3:a.b"
    assert p.catalog_ref == f"s0a1-train-2:{segment}.step-3:a.b"
    again = ParsedCheckpointTinkerPath.from_tag(p.training_run_id, p.tag)
    assert again.canonical == p.canonical and again.checkpoint_type == p.checkpoint_type
    assert has_checkpoint_scheme(path)
    # The SDK's own parser reads the canonical spelling the same way.
    sdk = tinker.ParsedCheckpointTinkerPath.from_tinker_path(p.canonical)
    assert (sdk.training_run_id, sdk.checkpoint_type) == (p.training_run_id, p.checkpoint_type)


@pytest.mark.parametrize("path", [
    "", "tinker://", "tinker://run", "tinker://run/weights", "tinker://run/weights/", "tinker:///weights/x",
    "tinker://run/checkpoints/x", "tinker://run/weights/a/b", "http://run/weights/x", "TINKER://run/weights/x",
    "run/weights/x", "tinker://run/weights/x/", " tinker://run/weights/x",
])
def test_checkpoint_path_refused(path):
    with pytest.raises(ValueError) as err:
        ParsedCheckpointTinkerPath.from_tinker_path(path)
    msg = str(err.value)
    assert "\n" not in msg and repr(path) in msg and "expected tinker://<run>/weights/<name>" in msg


def test_from_tag_other_tags_are_not_checkpoints():
    assert ParsedCheckpointTinkerPath.from_tag("r", "head") is None
    assert ParsedCheckpointTinkerPath.from_tag("r", "release.v1") is None
    with pytest.raises(ValueError, match="checkpoint path"):
        ParsedCheckpointTinkerPath.from_tag("r", "weights.a/b")  # a name no path can spell


@pytest.mark.parametrize("session, seq", [("s0123abcd", 0), ("s9", 7), ("s-x", 123)])
def test_model_id_round_trips(session, seq):
    mid = str(ModelId(session, seq))
    assert mid == f"{session}:train:{seq}"
    assert parse_model_id(mid) == ModelId(session, seq)
    assert run_id_of(mid) == f"{session}-train-{seq}" == ModelId(session, seq).run_id
    assert session_of(mid) == session


@pytest.mark.parametrize("model_id", [
    "", "s1", "s1:train", "s1:train:", ":train:0", "s1:train:x", "s1:train:-1", "s1:train:01", "s1:sample:0",
    "s1:train:0:1", "a:b:train:0", "s1-train-0",
])
def test_model_id_refused(model_id):
    with pytest.raises(ValueError) as err:
        parse_model_id(model_id)
    msg = str(err.value)
    assert "\n" not in msg and repr(model_id) in msg and "expected <session>:train:<n>" in msg
    assert session_of(model_id) is None
    assert run_id_of(model_id) == model_id  # a run id (or nothing the store knows) stays as it is


def test_catalog_refs():
    assert split_catalog_ref("pol") == ("pol", None)
    assert split_catalog_ref("pol:") == ("pol", None)
    assert split_catalog_ref("pol:sampler_weights.a:b") == ("pol", "sampler_weights.a:b")
    path = ParsedCheckpointTinkerPath.from_tinker_path("mint://r/weights/latest")
    assert checkpoint_ref(path, server_run=True) == "r:weights.latest"
    assert checkpoint_ref(path, server_run=False) == "r:latest"  # a policy published from outside: its own tags


def test_model_names_parse_into_one_form_each():
    assert parse_model_name("pol") == ModelName("pol", "pol")
    assert parse_model_name("pol:sampler_weights.a:b") == ModelName("pol:sampler_weights.a:b", "pol",
                                                                    tag="sampler_weights.a:b")
    assert parse_model_name("pol@abc123") == ModelName("pol@abc123", "pol", revision="abc123")
    m = parse_model_name("tinker://r/sampler_weights/x")
    assert m.policy == "r" and m.path.checkpoint_id == "x" and m.tag is None and m.revision is None


@pytest.mark.parametrize("name, expected", [
    ("", "expected <policy>:<tag>"), (":tag", "expected <policy>:<tag>"), (" pol", "expected <policy>:<tag>"),
    ("pol@abc", "6 to 64 lowercase hex"), ("pol@ABCDEF", "6 to 64 lowercase hex"), ("@abcdef", "6 to 64"),
    ("pol:x@abcdef", "6 to 64"), ("tinker://r/bogus/x", "expected tinker://<run>/weights/<name>"),
])
def test_model_names_refused(name, expected):
    with pytest.raises(ValueError) as err:
        parse_model_name(name)
    assert expected in str(err.value) and repr(name) in str(err.value) and "\n" not in str(err.value)


def test_model_names_resolve_in_a_catalog(tmp_path):
    import torch

    from dsv4flash.lifecycle import AdapterStore
    from dsv4flash.lifecycle.errors import RevisionNotFoundError
    from dsv4flash.lifecycle.fingerprint import BaseFingerprint

    store = AdapterStore(tmp_path)
    fp = BaseFingerprint(digest="sha256:" + "0" * 64, summary="test base")
    store.create_policy("run", fp, {SERVICE_META: {}})
    store.create_policy("outside", fp, {})
    one = store.publish("run", {"w": torch.ones(2)}, tags=["sampler_weights.s1"])
    two = store.publish("run", {"w": torch.zeros(2)})
    out = store.publish("outside", {"w": torch.full((2,), 3.0)}, tags=["latest"])
    cat = store.catalog
    for name, rev in [("run", two.id), ("run:head", two.id), ("run:sampler_weights.s1", one.id),
                      ("tinker://run/sampler_weights/s1", one.id), (f"run@{one.id[:8]}", one.id),
                      (f"run@{two.id}", two.id), ("outside:latest", out.id), ("tinker://outside/weights/latest", out.id),
                      ("outside", out.id)]:
        assert resolve_model_name(cat, name).id == rev, name
    for name in (f"outside@{one.id[:8]}", "run:nope", "tinker://run/weights/latest", "nobody"):
        with pytest.raises((RevisionNotFoundError, LookupError)):
            resolve_model_name(cat, name)


def test_lora_int_id_from_the_revision_id():
    rev = "0000000" + "f" * 57
    assert lora_int_id(rev) == 1  # never 0: vLLM reserves it
    assert lora_int_id("abcdef1" + "0" * 57) == 0xABCDEF1 + 1
    assert lora_int_id("abcdef1" + "9" * 57) == lora_int_id("abcdef1" + "0" * 57)  # the first 7 hex digits
