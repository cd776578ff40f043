"""Multimodal task: synthetic shape pictures; the answer can only be read off the image.

Each picture holds one large shape and up to two smaller ones (triangle, square, circle; four colours),
non-overlapping, on a mid-grey canvas. Questions: how many of one kind, how many in all, and the colour of
the largest shape (at least `size_margin`× the area of the next one). Mid-grey is zero after the [-1, 1]
pixel normalisation, so only the shapes drive the patch features (on white, pictures looked alike to the
freshly initialised ViT, cosine 0.78, and the tiny model took far longer to read them).

Layout for the tiny config: an 84×84 picture is 6×6 ViT patches, a 2×2 token grid after the 3×3
aligner, an 8-token span. The prompt puts the question first and the picture last
(`q : how many triangles ? <image>`, answer next), so the whole span lies inside the 8-token sliding
window of the answer position: the tiny model then reads the picture through window attention instead
of depending on the (gradient-free) indexer to select image rows from the compressed KV.
"""

from __future__ import annotations

import math

import numpy as np

from dsv4flash.tasks.base import Example, Task, normalise

KINDS = ("triangle", "square", "circle")
PLURAL = {"triangle": "triangles", "square": "squares", "circle": "circles"}
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
QUESTIONS = ("count_kind", "count_all", "largest_colour")
DESCRIBE = "describe"
BACKGROUND = (128, 128, 128)


def _area(kind: str, size: float) -> float:
    if kind == "square":
        return size * size
    if kind == "circle":
        return math.pi * size * size / 4
    return size * size * math.sqrt(3) / 4


def draw_shapes(shapes: list[dict], canvas: int) -> np.ndarray:
    """Render shapes (kind, colour, size, x, y = top-left of the bounding box) -> uint8 [canvas, canvas, 3]."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (canvas, canvas), BACKGROUND)
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
    """`q : how many triangles ? <image>` -> `2`; `q : what colour is the largest shape ? <image>` -> `blue`."""

    name = "geometry"
    multimodal = True

    def __init__(self, canvas: int = 84, max_shapes: int = 3, primary_size: tuple[int, int] = (36, 56),
                 other_size: tuple[int, int] = (12, 26), size_margin: float = 1.3,
                 questions: tuple[str, ...] = QUESTIONS) -> None:
        unknown = set(questions) - set(QUESTIONS) - {DESCRIBE}
        if unknown:
            raise ValueError(f"geometry task: unknown question kinds {sorted(unknown)}; expected some of "
                             f"{QUESTIONS + (DESCRIBE,)}")
        if not (max_shapes >= 1 and 0 < other_size[0] <= other_size[1] and 0 < primary_size[0] <= primary_size[1]
                and primary_size[1] + 4 < canvas):
            raise ValueError(f"geometry task: bad sizes (canvas {canvas}, primary {primary_size}, other {other_size}, "
                             f"max_shapes {max_shapes})")
        self.canvas, self.max_shapes = canvas, max_shapes
        self.primary_size, self.other_size, self.size_margin = tuple(primary_size), tuple(other_size), size_margin
        self.questions = tuple(questions)

    def _layout(self, rng: np.random.Generator) -> list[dict]:
        """One large shape and up to max_shapes-1 smaller ones, non-overlapping, the largest unique by
        `size_margin` in area (rejection sampling). Shapes are listed in drawing order, largest first."""
        while True:
            n = int(rng.integers(1, self.max_shapes + 1))
            shapes: list[dict] = []
            for i in range(n):
                low, high = self.primary_size if i == 0 else self.other_size
                for _attempt in range(50):
                    size = int(rng.integers(low, high + 1))
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
        if question == DESCRIBE:  # the count, then colour and kind of each shape, largest first
            items = " ".join(f"{s['colour']} {s['kind']}" for s in shapes)
            return question, "describe", f"{len(shapes)} {items}"
        largest = max(shapes, key=lambda s: _area(s["kind"], s["size"]))
        return question, "what colour is the largest shape ?", largest["colour"]

    def sample(self, rng: np.random.Generator) -> Example:
        """Draw a picture and one question about it."""
        shapes = self._layout(rng)
        image = draw_shapes(shapes, self.canvas)
        question, text, answer = self._question(shapes, rng)
        return Example(prompt=f"q : {text} <image>", answer=answer, images=(image,),
                       meta={"question": question, "shapes": shapes})

    def reward(self, example: Example, response: str) -> float:
        """Exact match of the count, colour word or description."""
        return 1.0 if normalise(response) == normalise(example.answer) else 0.0

    def wrong_answer(self, example: Example, rng: np.random.Generator) -> str:
        """Another colour, or a count off by one or two (never negative)."""
        if example.meta["question"] == "largest_colour":
            others = [c for c in COLOURS if c != example.answer]
            return others[int(rng.integers(len(others)))]
        if example.meta["question"] == DESCRIBE:  # recolour one shape
            words = example.answer.split()
            at = 1 + 2 * int(rng.integers((len(words) - 1) // 2))
            others = [c for c in COLOURS if c != words[at]]
            words[at] = others[int(rng.integers(len(others)))]
            return " ".join(words)
        value = int(example.answer)
        options = [v for v in (value - 2, value - 1, value + 1, value + 2) if 0 <= v <= self.max_shapes]
        return str(options[int(rng.integers(len(options)))])

    def words(self) -> tuple[str, ...]:
        """Template words, kinds (plural), colours and the digits of counts."""
        return ("q", "a", ":", "?", "<image>", "how", "many", "shapes", "what", "colour", "is", "the", "largest",
                "shape", DESCRIBE, *KINDS, *PLURAL.values(), *COLOURS, *(str(i) for i in range(self.max_shapes + 1)))


class GeometryDescribeTask(GeometryTask):
    """`q : describe <image>` -> `2 red triangle blue circle`: the count, then each shape, largest first.

    Dense supervision of what the pictures contain (every shape's colour and kind, the count, which is
    largest) for pretraining the base; the question-answer task `geometry` is then a new mapping over
    features the base already has, which is what the LoRA fine-tuning learns.
    """

    name = "geometry_describe"

    def __init__(self, **options) -> None:
        options.setdefault("questions", (DESCRIBE,))
        super().__init__(**options)
