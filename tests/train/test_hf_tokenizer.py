"""The task tokenizer through transformers' AutoTokenizer: the same ids as TaskTokenizer on every task text."""

import numpy as np
import pytest

from dsv4flash.tasks import TASKS, TaskTokenizer, build_task
from dsv4flash.tasks.hf_tokenizer import canonical_text, save_hf_tokenizer


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import AutoTokenizer

    tok = TaskTokenizer()
    directory = save_hf_tokenizer(tok, tmp_path_factory.mktemp("hf_tokenizer"))
    return tok, AutoTokenizer.from_pretrained(str(directory))


def test_every_task_text_encodes_to_the_same_ids(pair):
    tok, hf = pair
    rng = np.random.default_rng(0)
    seen = 0
    for name in TASKS:
        task = build_task(name)
        for _ in range(40):
            ex = task.sample(rng)
            for text in (ex.prompt, ex.answer):
                assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text), text
                seen += 1
            chat = hf.apply_chat_template([{"role": "user", "content": ex.prompt}], add_generation_prompt=True,
                                          tokenize=False)
            assert hf(chat, add_special_tokens=False)["input_ids"] == tok.encode(ex.prompt, bos=True)
    assert seen == 2 * 40 * len(TASKS)


def test_special_tokens_and_decoding(pair):
    tok, hf = pair
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert hf.convert_tokens_to_ids("<image>") == tok.image_id
    ids = tok.encode("what is 12 + 7 ?")
    text = hf.decode(ids, skip_special_tokens=True)
    assert text == "what is 1 2 + 7 ?" and canonical_text(text) == tok.decode(ids) == "what is 12 + 7 ?"
    assert canonical_text("purple 12") == "purple 12"  # unknown word: left as it is
    with pytest.raises(Exception):
        hf("a purple square", add_special_tokens=False)  # not in the vocabulary, as TaskTokenizer.encode


def test_every_model_id_has_a_token(pair):
    """A sampler can emit any id of the model's vocabulary: none decodes to nothing."""
    tok, hf = pair
    vocab = hf.get_vocab()
    assert sorted(vocab.values()) == list(range(tok.vocab_size))
    unused = next(i for i in range(tok.vocab_size) if f"<unused{i}>" in vocab)
    assert hf.decode([unused]) == f"<unused{unused}>"
    with pytest.raises(Exception):  # never produced by encoding text: "unused" is no task word
        hf(f"<unused{unused}>", add_special_tokens=False)


def test_the_server_keeps_its_tokenizer_directory_up_to_date(tmp_path):
    """The Tinker-protocol server's directory is `save_text_tokenizer`'s files (the served tokenizer: the task ids
    plus a byte fallback, tests/service/test_http_protocol.py), rewritten when the vocabulary or format changes."""
    from dsv4flash.tasks.text_tokenizer import FORMAT, ensure_hf_tokenizer_dir, save_text_tokenizer

    tok = TaskTokenizer("tiny")
    served = ensure_hf_tokenizer_dir(tmp_path / "served", tok)
    written = save_text_tokenizer(tok, tmp_path / "written")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (served / name).read_bytes() == (written / name).read_bytes(), name
    marker = served / "dsv4flash_tokenizer.json"
    stamp = marker.read_text()
    assert ensure_hf_tokenizer_dir(served, tok) == served and marker.read_text() == stamp  # fresh: untouched
    marker.write_text(stamp.replace(f'"format": {FORMAT}', f'"format": {FORMAT - 1}'))  # an older writer's
    ensure_hf_tokenizer_dir(served, tok)
    assert marker.read_text() == stamp
