"""Admission to the compute plane: a policy's calls go to a trainer that holds its base and whose placement shell
holds its LoRA; a policy no trainer of the server can hold is refused when it is created (HTTP 400 naming the
base or the field), never half-created and failed later."""

from __future__ import annotations


class AdmissionError(ValueError):
    """A policy no trainer of this server can hold; the message starts with the field at fault (`base`,
    `LoraConfig.rank`, `LoraConfig.preset`)."""


def check_base(digest: str, held, what: str) -> None:
    """Refuse `what` (a checkpoint, a policy) trained on the base `digest` unless it is the base `held` (a
    `BaseFingerprint`), naming both."""
    if digest != held.digest:
        raise AdmissionError(f"base: {what} was trained on base {digest[:19]}…, which no trainer of this server "
                             f"holds (it holds {held})")
