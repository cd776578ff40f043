"""Export the built-in tasks as veRL RL datasets (parquet): the same problems the local engine trains on.

Row layout (veRL `RLHFDataset`): `prompt` = chat messages, `images` = PNG bytes (multimodal rows; the
`<image>` placeholder in the text marks where each goes), `data_source` = task name, `reward_model` =
{style: rule, ground_truth}, `extra_info` = what `verl_reward.compute_score` needs.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from dsv4flash.tasks.base import Example
from dsv4flash.tasks.dataset import TaskMixture

REWARD_FUNCTION_FILE = Path(__file__).with_name("verl_reward.py")
# The same function in veRL's `pkg://` form: importable on every node that has dsv4flash (no local path).
REWARD_FUNCTION_MODULE = "pkg://dsv4flash.tasks.verl_reward"


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def _row(name: str, ex: Example, split: str, index: int, options: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in ex.meta.items() if k != "shapes"}
    return {
        "data_source": name,
        "prompt": [{"role": "user", "content": ex.prompt}],
        "images": [{"bytes": _png(img)} for img in ex.images],
        "ability": "vision" if ex.images else "text",
        "reward_model": {"style": "rule", "ground_truth": ex.answer},
        "extra_info": {"split": split, "index": index, "prompt_text": ex.prompt, "meta": json.dumps(meta),
                       "task_options": json.dumps(options.get(name, {}))},
    }


def export_parquet(mixture: TaskMixture, directory: str | os.PathLike, *, train_size: int,
                   task_options: dict[str, Any] | None = None) -> dict[str, Path]:
    """Write `train.parquet` (the training set of train_size problems, `TaskMixture.train_problems`) and
    `val.parquet` (the val split)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    options = dict(task_options or {})
    train = [_row(name, ex, "train", i, options) for i, (name, ex) in enumerate(mixture.train_problems(train_size))]
    val = [_row(name, ex, "val", i, options) for i, (name, ex) in enumerate(mixture.val)]
    out = {}
    for split, rows in (("train", train), ("val", val)):
        path = directory / f"{split}.parquet"
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
        out[split] = path
    return out
