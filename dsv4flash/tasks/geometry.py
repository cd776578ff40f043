"""Multimodal task: synthetic shape pictures; the answer can only be read off the image.

Each picture holds 1–4 non-overlapping shapes (triangle, square, circle) in four colours on a white
canvas. Questions: how many of one kind, how many in all, and the colour of the largest shape (drawn so
the largest is at least `size_margin`× the area of the next one). Pictures are `canvas`×`canvas` pixels,
126 by default: 9×9 ViT patches of the tiny config, a 3×3 token grid after the aligner (14 span tokens).
"""

from __future__ import annotations

import math

import numpy as np

from dsv4flash.tasks.base import Example, Task, normalise

KINDS = ("triangle", "square", "circle")
PLURAL = {"triangle": "triangles", "square": "squares", "circle": "circles"}
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
QUESTIONS = ("count_kind", "count_all", "largest_colour")


def _area(kind: str, size: float) -> float:
    if kind == "square":
        return size * size
    if kind == "circle":
        return math.pi * size * size / 4
    return size * size * math.sqrt(3) / 4


def draw_shapes(shapes: list[dict], canvas: int) -> np.ndarray:
    """Render shapes (kind, colour, size, x, y = top-left of the bounding box) -> uint8 [canvas, canvas, 3]."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (canvas, canvas), (255, 255, 255))
    pen = ImageDraw.Draw(img)
    for s in shapes:
        x, y, size, fill = s["x"], s["y"], s["size"], COLOURS[s["colour"]]
        if s["kind"] == "square":
            pen.rectangle((x, y, x + size - 1, y + size - 1), fill=fill)
        elif s["kind"] == "circle":
            pen.ellipse((x, y, x + size - 1, y + size - 1), fill=fill)
        else:
            height = size * math.sqrt(3) / 2
            top = y + (size - height) / 2
            pen.polygon(((x + size / 2, top), (x, top + height), (x + size - 1, top + height)), fill=fill)
    return np.asarray(img, dtype=np.uint8).copy()


class GeometryTask(Task):
    """`q : <image> how many triangles ? a :` -> `2`; `what colour is the largest shape ?` -> `blue`."""

    name = "geometry"
    multimodal = True

    def __init__(self, canvas: int = 126, max_shapes: int = 4, min_size: int = 18, max_size: int = 50,
                 size_margin: float = 1.3, questions: tuple[str, ...] = QUESTIONS,
                 questions_per_image: int = 1) -> None:
        unknown = set(questions) - set(QUESTIONS)
        if unknown:
            raise ValueError(f"geometry task: unknown question kinds {sorted(unknown)}; expected some of {QUESTIONS}")
        if questions_per_image < 1:
            raise ValueError(f"geometry task: questions_per_image must be >= 1, got {questions_per_image}")
        self.canvas, self.max_shapes = canvas, max_shapes
        self.min_size, self.max_size, self.size_margin = min_size, max_size, size_margin
        self.questions = tuple(questions)
        # >1: earlier questions are asked and answered in the prompt (dense supervision per picture for
        # pretraining, where every text token is scored); the example's answer is the last one.
        self.questions_per_image = questions_per_image

    def _layout(self, rng: np.random.Generator) -> list[dict]:
        """Non-overlapping shapes with a unique largest one (rejection sampling)."""
        while True:
            n = int(rng.integers(1, self.max_shapes + 1))
            shapes: list[dict] = []
            for _ in range(n):
                for _attempt in range(50):
                    size = int(rng.integers(self.min_size, self.max_size + 1))
                    x, y = (int(v) for v in rng.integers(2, self.canvas - size - 2, size=2))
                    if all(x + size + 3 <= o["x"] or o["x"] + o["size"] + 3 <= x or
                           y + size + 3 <= o["y"] or o["y"] + o["size"] + 3 <= y for o in shapes):
                        shapes.append({"kind": KINDS[int(rng.integers(3))],
                                       "colour": tuple(COLOURS)[int(rng.integers(len(COLOURS)))],
                                       "size": size, "x": x, "y": y})
                        break
            areas = sorted((_area(s["kind"], s["size"]) for s in shapes), reverse=True)
            if len(shapes) == n and (n == 1 or areas[0] >= self.size_margin * areas[1]):
                return shapes

    def _question(self, shapes: list[dict], rng: np.random.Generator) -> tuple[str, str, str]:
        question = self.questions[int(rng.integers(len(self.questions)))]
        if question == "count_kind":
            kind = KINDS[int(rng.integers(3))]
            return question, f"how many {PLURAL[kind]} ?", str(sum(s["kind"] == kind for s in shapes))
        if question == "count_all":
            return question, "how many shapes ?", str(len(shapes))
        largest = max(shapes, key=lambda s: _area(s["kind"], s["size"]))
        return question, "what colour is the largest shape ?", largest["colour"]

    def sample(self, rng: np.random.Generator) -> Example:
        """Draw a picture and `questions_per_image` questions about it (the last one is the example's)."""
        shapes = self._layout(rng)
        image = draw_shapes(shapes, self.canvas)
        asked = [self._question(shapes, rng) for _ in range(self.questions_per_image)]
        prompt = "q : <image> " + " q : ".join(f"{text} a : {answer}" for _, text, answer in asked[:-1])
        question, text, answer = asked[-1]
        prompt = f"{prompt} q : {text} a :" if len(asked) > 1 else f"q : <image> {text} a :"
        return Example(prompt=prompt, answer=answer, images=(image,), meta={"question": question, "shapes": shapes})

    def reward(self, example: Example, response: str) -> float:
        """Exact match of the count or colour word."""
        return 1.0 if normalise(response) == example.answer else 0.0

    def wrong_answer(self, example: Example, rng: np.random.Generator) -> str:
        """Another colour, or a count off by one or two (never negative)."""
        if example.meta["question"] == "largest_colour":
            others = [c for c in COLOURS if c != example.answer]
            return others[int(rng.integers(len(others)))]
        value = int(example.answer)
        options = [v for v in (value - 2, value - 1, value + 1, value + 2) if 0 <= v <= self.max_shapes]
        return str(options[int(rng.integers(len(options)))])

    def words(self) -> tuple[str, ...]:
        """Template words, kinds (plural), colours and the digits of counts."""
        return ("q", "a", ":", "?", "<image>", "how", "many", "shapes", "what", "colour", "is", "the", "largest",
                "shape", *PLURAL.values(), *COLOURS, *(str(i) for i in range(self.max_shapes + 1)))
