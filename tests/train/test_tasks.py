"""Built-in tasks: tokenizer, verifiers, image-dependent geometry answers, disjoint deterministic splits."""

import numpy as np
import pytest
import torch

from dsv4flash.config import load_config
from dsv4flash.tasks import TASKS, Encoder, TaskMixture, TaskTokenizer, TokenizerError, build_task
from dsv4flash.tasks.countdown import ExpressionError, evaluate
from dsv4flash.tasks.geometry import COLOURS, GeometryTask, draw_shapes

CFG = load_config("tiny")


def test_tokenizer_round_trip_and_special_ids(tmp_path):
    tok = TaskTokenizer(CFG)
    text = "q : <image> how many triangles ? a : 12"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == CFG.bos_token_id and ids[-1] == CFG.eos_token_id
    assert CFG.image_token_id in ids and max(ids) < CFG.text.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("3 * 5 + 7")) == "3 * 5 + 7"
    with pytest.raises(TokenizerError, match="'hexagon'"):
        tok.encode("how many hexagon")
    tok.save(tmp_path)
    again = TaskTokenizer.load(tmp_path, CFG)
    assert again.encode(text) == tok.encode(text)


def test_every_task_word_is_in_the_vocabulary():
    tok = TaskTokenizer(CFG)
    for name, cls in TASKS.items():
        for word in cls().words():
            assert word == "<image>" or tok.has_word(word), f"{name}: {word!r} missing from the tokenizer"


def test_countdown_verifier():
    task = build_task("countdown")
    assert evaluate("3 * 5 + 7") == (22, [3, 5, 7])
    assert evaluate("(3 + 5) * 7")[0] == 56
    with pytest.raises(ExpressionError):
        evaluate("3 * + 5")
    rng = np.random.default_rng(0)
    for _ in range(20):
        ex = task.sample(rng)
        assert task.reward(ex, ex.answer) == 1.0
        wrong = task.wrong_answer(ex, rng)
        assert task.reward(ex, wrong) < 1.0
    ex = task.sample(np.random.default_rng(1))
    assert task.reward(ex, "banana") == 0.0


def test_arithmetic_answers_and_wrong_answers():
    task = build_task("arithmetic")
    rng = np.random.default_rng(0)
    for _ in range(30):
        ex = task.sample(rng)
        a, op, b = ex.prompt.split()[2:5]
        assert int(ex.answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert task.reward(ex, ex.answer) == 1.0 and task.reward(ex, task.wrong_answer(ex, rng)) == 0.0


def test_geometry_answer_is_read_off_the_image():
    task = GeometryTask()
    rng = np.random.default_rng(0)
    for _ in range(40):
        ex = task.sample(rng)
        shapes = ex.meta["shapes"]
        img = ex.images[0]
        assert img.shape == (84, 84, 3) and img.dtype == np.uint8
        for s in shapes:  # every shape's centre pixel has its colour
            cx, cy = s["x"] + s["size"] // 2, s["y"] + int(s["size"] * 0.6)
            assert tuple(img[cy, cx]) == COLOURS[s["colour"]]
        if ex.meta["question"] == "count_all":
            assert ex.answer == str(len(shapes))
        # redrawing the same layout gives the same picture: the answer is a function of the image
        assert np.array_equal(draw_shapes(shapes, 84), img)
    with pytest.raises(ValueError, match="question kinds"):
        GeometryTask(questions=("count_all", "area"))


def test_splits_are_disjoint_and_deterministic():
    tasks = {n: build_task(n) for n in TASKS}
    weights = {n: 1.0 for n in TASKS}
    a = TaskMixture(tasks, weights, seed=3, val_size=64)
    b = TaskMixture(tasks, weights, seed=3, val_size=64)
    val_keys = {ex.key() for _, ex in a.val}
    assert [ex.key() for _, ex in a.val] == [ex.key() for _, ex in b.val]
    for step in range(20):
        batch = a.train_batch(step, 16)
        assert [ex.key() for _, ex in batch] == [ex.key() for _, ex in b.train_batch(step, 16)]
        assert not val_keys & {ex.key() for _, ex in batch}
    assert [ex.key() for _, ex in a.train_batch(0, 8)] != [ex.key() for _, ex in a.train_batch(1, 8)]


def test_a_finite_training_set_is_read_once_per_epoch_in_a_new_order():
    """`data.train_size`: the first N problems of the training stream (the veRL export's rows), each once per epoch,
    a new seeded order each epoch, batches across epoch ends; the same for the same seed; never a val problem."""
    tasks = {n: build_task(n) for n in ("arithmetic", "geometry")}
    weights = dict.fromkeys(tasks, 1.0)
    mix = TaskMixture(tasks, weights, seed=3, val_size=16, train_size=6)
    problems = [ex.key() for _, ex in mix.train_problems(6)]
    assert problems == [ex.key() for _, ex in TaskMixture(tasks, weights, 3, 16).train_problems(300)[:6]]
    assert problems == [ex.key() for _, ex in TaskMixture(tasks, weights, 3, 16).train_batch(0, 6)]  # stream's start
    read = [ex.key() for step in range(5) for _, ex in mix.train_batch(step, 4)]  # 20 reads: 3 epochs and 2 more
    epochs = [read[i:i + 6] for i in range(0, 18, 6)]
    assert all(sorted(epoch) == sorted(problems) for epoch in epochs) and set(read[18:]) <= set(problems)
    assert len({tuple(epoch) for epoch in epochs}) == 3  # reshuffled each epoch
    again = TaskMixture(tasks, weights, seed=3, val_size=16, train_size=6)
    assert [ex.key() for _, ex in again.train_batch(3, 4)] == read[12:16]  # a pure function of (seed, step)
    assert not {ex.key() for _, ex in mix.val} & set(problems)
    with pytest.raises(ValueError, match="data.train_size must be a positive number"):
        TaskMixture(tasks, weights, seed=3, val_size=16, train_size=0)


def test_encoder_scores_answer_tokens_and_expands_images():
    tok = TaskTokenizer(CFG)
    enc = Encoder(tok, CFG)
    mix = TaskMixture({"geometry": build_task("geometry"), "arithmetic": build_task("arithmetic")},
                      {"geometry": 1.0, "arithmetic": 1.0}, seed=0, val_size=4)
    examples = [ex for _, ex in mix.train_batch(0, 6)]
    batch = enc.batch(examples)
    n_images = sum(len(ex.images) for ex in examples)
    assert len(batch.images) == n_images
    assert int((batch.token_types == 0).sum()) == n_images  # one IMAGE_START per image span
    for row, ex in enumerate(examples):
        scored = batch.input_ids[row][batch.target_mask[row]].tolist()
        assert scored == tok.encode(ex.answer, eos=True)
    lm = enc.batch(examples, score_prompt=True)
    assert bool((lm.target_mask & (lm.token_types >= 0)).sum() == 0)  # image positions never scored
    assert int(lm.target_mask.sum()) > int(batch.target_mask.sum())
    assert torch.equal(batch.lengths, lm.lengths)
