"""The task tokenizer as a Hugging Face fast tokenizer, for tools that load one by path (veRL, vLLM).

`save_hf_tokenizer(tok, directory)` writes `tokenizer.json` (a `tokenizers` WordLevel model over the same
ids), `tokenizer_config.json` and `special_tokens_map.json`, so `AutoTokenizer.from_pretrained(directory)`
encodes every task text to exactly the ids of `TaskTokenizer.encode` (lower-casing, digits one by one,
`<image>` as the config's `image_token_id`; an unknown word is an error; ids no task text uses decode as
`<unusedN>`). The chat template renders a conversation as the local engine does a prompt: `bos` + the user
text, nothing added for generation. The Tinker-protocol server serves the same files
(`dsv4flash.tasks.text_tokenizer`).
Decoding joins tokens with spaces (digits too); `canonical_text` maps such text back to the task form.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dsv4flash.atomic_io import write_bytes_atomic
from dsv4flash.tasks.tokenizer import IMAGE_PLACEHOLDER, TaskTokenizer, TokenizerError

SPECIAL_NAMES = {"bos": "<bos>", "eos": "<eos>", "pad": "<pad>"}
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
# TaskTokenizer's split, without `<image>` (an added token, matched before pre-tokenization).
PIECE_PATTERN = r"\d|[a-z]+|[^\sa-z\d]"
TOKENIZER_SETTINGS = {"bos_token": SPECIAL_NAMES["bos"], "eos_token": SPECIAL_NAMES["eos"],
                      "pad_token": SPECIAL_NAMES["pad"], "additional_special_tokens": [IMAGE_PLACEHOLDER],
                      "chat_template": CHAT_TEMPLATE, "model_max_length": 1 << 20,
                      "clean_up_tokenization_spaces": False}


def build_hf_tokenizer(tok: TaskTokenizer):
    """A `tokenizers.Tokenizer` with `tok`'s vocabulary and ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers

    vocab = {sym: tok._ids[sym] for sym in tok.symbols}
    specials = {SPECIAL_NAMES["bos"]: tok.bos_id, SPECIAL_NAMES["eos"]: tok.eos_id,
                SPECIAL_NAMES["pad"]: tok.pad_id, IMAGE_PLACEHOLDER: tok.image_id}
    vocab.update(specials)
    # Every id of the model's vocabulary gets a token (a sampler can emit any id; a hole in the WordLevel
    # vocabulary decodes to nothing); these names never come out of the splitter.
    used = set(vocab.values())
    vocab.update({f"<unused{i}>": i for i in range(tok.vocab_size) if i not in used})
    hf = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    hf.normalizer = normalizers.Lowercase()
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(PIECE_PATTERN), behavior="isolated")])
    hf.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    return hf


def load_hf_tokenizer(tok: TaskTokenizer):
    """`tok` as a `PreTrainedTokenizerFast` in memory (what `save_hf_tokenizer` + `AutoTokenizer` give)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=build_hf_tokenizer(tok), **TOKENIZER_SETTINGS)


def save_hf_tokenizer(tok: TaskTokenizer, directory: str | os.PathLike) -> Path:
    """Write the HF tokenizer files of `tok` into `directory` (each file atomically) -> the directory."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(target / "tokenizer.json", build_hf_tokenizer(tok).to_str(pretty=True).encode())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **TOKENIZER_SETTINGS}
    write_bytes_atomic(target / "tokenizer_config.json", (json.dumps(config, indent=1) + "\n").encode())
    special = {k: v for k, v in config.items() if k.endswith("_token") or k == "additional_special_tokens"}
    write_bytes_atomic(target / "special_tokens_map.json", (json.dumps(special, indent=1) + "\n").encode())
    return target


def canonical_text(text: str, tok: TaskTokenizer | None = None) -> str:
    """`text` as `TaskTokenizer.decode` writes it (digits joined); unchanged if it has an unknown word."""
    tok = tok or TaskTokenizer()
    try:
        return tok.decode(tok.encode(text), stop_at_eos=False)
    except TokenizerError:
        return text
