"""`dsv4flash smoke` (or `python -m dsv4flash.cli.smoke`): build the tiny reference model, run a multimodal forward+backward, report."""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dsv4flash smoke` takes no arguments."""


def run(args: argparse.Namespace) -> int:
    """`dsv4flash smoke`."""
    return main()


def main() -> int:
    """Run the smoke check and print what it measured."""
    import numpy as np
    import torch

    from dsv4flash.release.census import census
    from dsv4flash.config import load_config
    from dsv4flash.model.image import prepare_vl_inputs
    from dsv4flash.model.transformer import Transformer

    cfg = load_config("tiny")
    model = Transformer(cfg, seed=0)
    image = np.random.default_rng(0).integers(0, 256, size=(42, 84, 3), dtype=np.uint8)
    prompt = torch.tensor([5, 6, cfg.image_token_id] + list(range(10, 60)))
    ids, types, images = prepare_vl_inputs(prompt, [image], cfg, dtype=torch.float32)
    start = time.perf_counter()
    logits = model(ids[None], types[None], images)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[1:])
    loss.backward()
    elapsed = time.perf_counter() - start
    rows = census("flash")
    print(f"tiny model: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{len(cfg.backbone_plan)} layers ({', '.join(p.mode for p in cfg.backbone_plan)})")
    print(f"multimodal forward+backward over {ids.numel()} tokens: loss {loss.item():.4f} in {elapsed * 1e3:.0f} ms")
    print(f"flash census from the meta-built model: {len(rows):,} tensors, "
          f"{sum(r.nbytes for r in rows) / 1e9:.1f} GB in the release layout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
