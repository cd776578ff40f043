"""A word-level tokenizer over the tiny 512-id vocabulary, for the built-in tasks.

Numbers are spelled digit by digit, words and symbols are single tokens, whitespace is not a token.
Special ids come from the model config (bos/eos/pad, and `image_token_id` for `<image>`); the regular
symbols take the ids from `FIRST_SYMBOL_ID` upwards. The table is fixed in code and saved next to every
base model, so a base and its adapters always agree on ids.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Sequence

from dsv4flash.atomic_io import write_bytes_atomic
from dsv4flash.config import DSV41FlashConfig, load_config

IMAGE_PLACEHOLDER = "<image>"
TASK_TOKENIZER_KIND = "dsv4flash-task-words"  # `kind` in the task tokenizer.json
FIRST_SYMBOL_ID = 3

# Order is the id order: never reorder or delete, only append (ids are baked into base models).
SYMBOLS: tuple[str, ...] = (
    *"0123456789",
    "+", "-", "*", "/", "=", "(", ")", "?", ":", ",", ".",
    "q", "a", "what", "is", "how", "many", "which", "the", "of", "in", "image",
    "numbers", "target", "make", "using", "each", "once",
    "shape", "shapes", "triangle", "triangles", "square", "squares", "circle", "circles",
    "colour", "largest", "smallest", "red", "green", "blue", "yellow", "none",
    "describe",
)

_TOKEN_RE = re.compile(r"<image>|\d|[a-z]+|[^\sa-z\d]")


class TokenizerError(ValueError):
    """Text or ids the tokenizer cannot represent."""


class TaskTokenizer:
    """Encode/decode task text; `<image>` maps to the config's `image_token_id`."""

    def __init__(self, cfg: DSV41FlashConfig | str = "tiny", symbols: Sequence[str] = SYMBOLS) -> None:
        cfg = load_config(cfg)
        self.vocab_size = cfg.text.vocab_size
        self.bos_id, self.eos_id, self.pad_id = cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id
        self.image_id = cfg.image_token_id
        self.symbols = tuple(symbols)
        self._ids = {sym: FIRST_SYMBOL_ID + i for i, sym in enumerate(self.symbols)}
        reserved = {self.bos_id, self.eos_id, self.pad_id, self.image_id}
        last = FIRST_SYMBOL_ID + len(self.symbols) - 1
        clash = reserved & set(self._ids.values())
        if last >= self.vocab_size or clash:
            raise TokenizerError(f"tokenizer: {len(self.symbols)} symbols from id {FIRST_SYMBOL_ID} need ids up to "
                                 f"{last}; vocab_size is {self.vocab_size} and ids {sorted(clash)} are reserved "
                                 "(bos/eos/pad/image_token_id)")
        self._syms = {i: s for s, i in self._ids.items()}
        self._syms[self.image_id] = IMAGE_PLACEHOLDER

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Text -> ids; an unknown word raises naming it."""
        ids = [self.bos_id] if bos else []
        for tok in _TOKEN_RE.findall(text.lower()):
            if tok == IMAGE_PLACEHOLDER:
                ids.append(self.image_id)
            elif tok in self._ids:
                ids.append(self._ids[tok])
            else:
                raise TokenizerError(f"tokenizer: {tok!r} (in {text!r}) is not in the task vocabulary")
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], *, stop_at_eos: bool = True) -> str:
        """Ids -> text (digits joined, other tokens space-separated); bos/pad dropped."""
        out: list[str] = []
        for i in ids:
            i = int(i)
            if i == self.eos_id and stop_at_eos:
                break
            if i in (self.bos_id, self.pad_id, self.eos_id):
                continue
            sym = self._syms.get(i, f"<unk:{i}>")
            if out and sym.isdigit() and out[-1][-1:].isdigit():
                out[-1] += sym
            else:
                out.append(sym)
        return " ".join(out)

    def has_word(self, word: str) -> bool:
        """Whether a symbol is in the vocabulary."""
        return word in self._ids

    def save(self, directory: str | os.PathLike) -> None:
        """Write `tokenizer.json` (symbols and special ids) atomically."""
        path = Path(directory) / "tokenizer.json"
        data = {"kind": TASK_TOKENIZER_KIND, "first_symbol_id": FIRST_SYMBOL_ID, "symbols": list(self.symbols),
                "bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id, "image_id": self.image_id}
        write_bytes_atomic(path, (json.dumps(data, indent=1) + "\n").encode())

    @classmethod
    def load(cls, directory: str | os.PathLike, cfg: DSV41FlashConfig | str = "tiny") -> "TaskTokenizer":
        """Read `tokenizer.json`; its special ids must match the model config."""
        path = Path(directory) / "tokenizer.json"
        data = json.loads(path.read_text())
        tok = cls(cfg, data["symbols"])
        saved = (data["bos_id"], data["eos_id"], data["pad_id"], data["image_id"], data["first_symbol_id"])
        if saved != (tok.bos_id, tok.eos_id, tok.pad_id, tok.image_id, FIRST_SYMBOL_ID):
            raise TokenizerError(f"{path}: special ids (bos, eos, pad, image, first symbol) {saved} do not match the "
                                 f"model config {(tok.bos_id, tok.eos_id, tok.pad_id, tok.image_id, FIRST_SYMBOL_ID)}")
        return tok
