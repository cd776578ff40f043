"""The tokenizer `dsv4flash serve` hands to Tinker clients: a Hugging Face directory (`tokenizer_id`, and the base's
served name) that encodes any text and decodes it back exactly.

The task tokenizer (`dsv4flash.tasks`, and its HF form for veRL / vLLM) knows the task words only and drops
whitespace, so arbitrary text — a chat, a user's dataset, tinker-cookbook's renderers — could not be encoded.
This one keeps every id of the task vocabulary (words, digits, symbols, bos/eos/pad, `<image>`) and adds, on ids
the task vocabulary leaves free:

- a byte fallback: one id per byte `<0x00>`…`<0xFF>`; a piece that is not a task word goes out as its UTF-8 bytes
  (whitespace and capitals included), so `decode(encode(text)) == text` for every string;
- DeepSeek V4.1's chat markup as single tokens (`<｜User｜>`, `<｜Assistant｜>`, `<｜System｜>`, `<think>`,
  `</think>`), with bos/eos named `<｜begin▁of▁sentence｜>` / `<｜end▁of▁sentence｜>`, and the release's chat-mode
  template, so tinker-cookbook's `deepseekv4_1_disable_thinking` renderer (and `role_colon`, plain text) build data.

A task word's id is the same as in the task tokenizer, but text is not split the same way: whitespace is bytes
here, dropped there. Task data is encoded piece by piece (`encode_task_text`) to get the task tokenizer's ids.
The SDK loads the directory with `AutoTokenizer.from_pretrained(tokenizer_id)`, offline.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsv4flash.atomic_io import publish_directory, write_bytes_atomic
from dsv4flash.tasks.tokenizer import IMAGE_PLACEHOLDER, TaskTokenizer

# Bumped when the files written for the same vocabulary change (stores rewrite theirs).
FORMAT = 3

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
MARKUP = ("<｜User｜>", "<｜Assistant｜>", "<｜System｜>", "<think>", "</think>")
# Task words are lower-case letter runs; anything else is a piece of its own (one character, or a whitespace run),
# so a task word inside other text ("the" in "the quick") keeps its id and the rest falls back to bytes.
PIECE_PATTERN = r"\d|[a-z]+|\s+|[^\sa-z\d]"
# DeepSeek V4.1's chat template in chat mode (no reasoning), as the cookbook's deepseekv4_1_disable_thinking renders
# it: bos, an optional system turn, user turns, assistant turns closed by eos.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}<｜System｜>{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<｜Assistant｜></think>{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜></think>{% endif %}")
SETTINGS = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
            "additional_special_tokens": [IMAGE_PLACEHOLDER, *MARKUP], "chat_template": CHAT_TEMPLATE,
            "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}


def layout(task: TaskTokenizer) -> tuple[dict[str, int], dict[str, int]]:
    """(regular vocabulary, special tokens) -> ids: the task ids, then bytes, chat markup and `<unusedN>`."""
    # Bytes and markup take the highest ids the task vocabulary leaves free, since task symbols are appended
    # upwards from the bottom.
    vocab = {sym: task._ids[sym] for sym in task.symbols}
    specials = {BOS: task.bos_id, EOS: task.eos_id, PAD: task.pad_id, IMAGE_PLACEHOLDER: task.image_id}
    taken = set(vocab.values()) | set(specials.values())
    free = [i for i in range(task.vocab_size - 1, -1, -1) if i not in taken]
    if len(free) < 256 + len(MARKUP):
        raise ValueError(f"tokenizer: vocab_size {task.vocab_size} leaves {len(free)} free ids; the byte fallback and "
                         f"chat markup need {256 + len(MARKUP)}")
    vocab.update({f"<0x{b:02X}>": i for b, i in enumerate(sorted(free[:256]))})
    specials.update(dict(zip(MARKUP, free[256:256 + len(MARKUP)])))
    # A sampler can emit any id of the model: every other id decodes to a name (no text encodes to it, since the
    # splitter never yields `<unusedN>` whole).
    vocab.update({f"<unused{i}>": i for i in free[256 + len(MARKUP):]})
    return vocab, specials


def build_text_tokenizer(task: TaskTokenizer):
    """The served `tokenizers.Tokenizer` over `task`'s vocabulary (module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab, specials = layout(task)
    # BPE without merges: a piece in the vocabulary is one token (ignore_merges), any other piece splits into
    # characters, and a character not in the vocabulary into its UTF-8 byte tokens (byte_fallback).
    hf = Tokenizer(models.BPE(vocab={**vocab, **specials}, merges=[], byte_fallback=True, ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE_PATTERN), behavior="isolated")
    hf.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    hf.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    return hf


def save_text_tokenizer(task: TaskTokenizer, directory: str | Path) -> Path:
    """Write the served tokenizer's files into `directory` (each atomically) -> the directory."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(target / "tokenizer.json", build_text_tokenizer(task).to_str(pretty=True).encode())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **SETTINGS}
    write_bytes_atomic(target / "tokenizer_config.json",
                       (json.dumps(config, indent=1, ensure_ascii=False) + "\n").encode())
    special = {k: v for k, v in config.items() if k.endswith("_token") or k == "additional_special_tokens"}
    write_bytes_atomic(target / "special_tokens_map.json",
                       (json.dumps(special, indent=1, ensure_ascii=False) + "\n").encode())
    return target


def ensure_hf_tokenizer_dir(directory: str | Path, task: TaskTokenizer) -> Path:
    """Write the served tokenizer directory if missing or stale (atomically) -> its path."""
    directory = Path(directory)
    stamp = {"format": FORMAT, "symbols": list(task.symbols), "vocab_size": task.vocab_size,
             "ids": [task.bos_id, task.eos_id, task.pad_id, task.image_id]}
    marker = directory / "dsv4flash_tokenizer.json"
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return directory

    def write(tmp: Path) -> None:
        save_text_tokenizer(task, tmp)
        (tmp / marker.name).write_text(json.dumps(stamp))

    return publish_directory(directory, write, overwrite=True, what="tokenizer directory")


def encode_task_text(tokenizer, text: str) -> list[int]:
    """Task text -> the task tokenizer's ids, through the served tokenizer."""
    # Each whitespace-separated piece alone, lower-cased as the task tokenizer does: no whitespace byte enters
    # (the task tokenizer has no whitespace ids).
    return [int(t) for piece in text.lower().split() for t in tokenizer.encode(piece, add_special_tokens=False)]


def decode_task_text(tokenizer, ids) -> str:
    """Task ids -> `TaskTokenizer.decode`'s text (spaced tokens, joined digits, up to eos), via the served tokenizer."""
    from dsv4flash.tasks.hf_tokenizer import canonical_text

    ids = [int(t) for t in ids]
    if tokenizer.eos_token_id in ids:
        ids = ids[:ids.index(tokenizer.eos_token_id)]
    dropped = {tokenizer.bos_token_id, tokenizer.pad_token_id}
    return canonical_text(" ".join(tokenizer.decode([t]) for t in ids if t not in dropped))
