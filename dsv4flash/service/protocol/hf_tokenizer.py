"""The resident base's task tokenizer as a Hugging Face tokenizer directory (`tokenizer_id` of `get_info`).

The Tinker SDK loads `AutoTokenizer.from_pretrained(tokenizer_id)`; a local directory path works offline. The
directory holds a `tokenizers` WordLevel model over exactly the task vocabulary (same ids as `TaskTokenizer`,
same splitting: lowercase, `<image>`, single digits, words, single symbols), written once per server store.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsv4flash.atomic_io import publish_directory
from dsv4flash.tasks.tokenizer import _TOKEN_RE, FIRST_SYMBOL_ID, IMAGE_PLACEHOLDER, TaskTokenizer

SPECIAL = {"bos": "<bos>", "eos": "<eos>", "pad": "<pad>"}


def build_hf_tokenizer(task: TaskTokenizer):
    """A `transformers.PreTrainedTokenizerFast` with `task`'s ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {sym: FIRST_SYMBOL_ID + i for i, sym in enumerate(task.symbols)}
    vocab.update({SPECIAL["bos"]: task.bos_id, SPECIAL["eos"]: task.eos_id, SPECIAL["pad"]: task.pad_id,
                  IMAGE_PLACEHOLDER: task.image_id})
    used = set(vocab.values())
    # Every id gets a token (the model can sample any id); these names never come out of the splitter.
    vocab.update({f"<unused{i}>": i for i in range(task.vocab_size) if i not in used})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(Regex(_TOKEN_RE.pattern), behavior="isolated")])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL["bos"], eos_token=SPECIAL["eos"],
                                   pad_token=SPECIAL["pad"], additional_special_tokens=[IMAGE_PLACEHOLDER])


def ensure_hf_tokenizer_dir(directory: str | Path, task: TaskTokenizer) -> Path:
    """Write the HF tokenizer directory if missing or stale (atomically) -> its path."""
    directory = Path(directory)
    stamp = {"symbols": list(task.symbols), "ids": [task.bos_id, task.eos_id, task.pad_id, task.image_id]}
    marker = directory / "dsv4flash_tokenizer.json"
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return directory

    def write(tmp: Path) -> None:
        build_hf_tokenizer(task).save_pretrained(str(tmp))
        (tmp / marker.name).write_text(json.dumps(stamp))

    return publish_directory(directory, write, overwrite=True, what="tokenizer directory")
