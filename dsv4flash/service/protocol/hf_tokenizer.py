"""The resident base's task tokenizer as a Hugging Face tokenizer directory (`tokenizer_id` of `get_info`).

The Tinker SDK loads `AutoTokenizer.from_pretrained(tokenizer_id)`; a local directory path works offline. The
files are `dsv4flash.tasks.hf_tokenizer`'s (the one HF form of the task tokenizer, also what veRL loads),
written once per server store and rewritten when the vocabulary or the format changes.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsv4flash.atomic_io import publish_directory
from dsv4flash.tasks.hf_tokenizer import save_hf_tokenizer
from dsv4flash.tasks.tokenizer import TaskTokenizer

# Bumped when `save_hf_tokenizer` writes different files for the same vocabulary (stores rewrite theirs).
FORMAT = 2


def ensure_hf_tokenizer_dir(directory: str | Path, task: TaskTokenizer) -> Path:
    """Write the HF tokenizer directory if missing or stale (atomically) -> its path."""
    directory = Path(directory)
    stamp = {"format": FORMAT, "symbols": list(task.symbols), "vocab_size": task.vocab_size,
             "ids": [task.bos_id, task.eos_id, task.pad_id, task.image_id]}
    marker = directory / "dsv4flash_tokenizer.json"
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return directory

    def write(tmp: Path) -> None:
        save_hf_tokenizer(task, tmp)
        (tmp / marker.name).write_text(json.dumps(stamp))

    return publish_directory(directory, write, overwrite=True, what="tokenizer directory")
