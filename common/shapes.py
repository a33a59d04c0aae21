"""Scenes of the ``shapes`` dataset generator (common/datasets.py): a visual question about a
drawn scene of coloured shapes.

Every question's text is the same across scenes, so only the image tells the answer: a model
that reads text alone is at chance. Questions (``question``):

- ``largest_colour``: "Which colour is the largest shape?" (2-3 shapes of one kind, distinct
  colours and sizes);
- ``count_circles``: "How many circles are there?" (1-4 shapes, 0-3 of them circles);
- ``square_side``: "Is the square on the left or the right?" (one square among 1-3 shapes);
- ``mixed`` (default): one of the three, drawn per task.

Like ``arith``, one scene in ``HOLD_OUT_EVERY`` (by a hash of its description) is held out of
``train`` and every other split draws only those. Answers are one word; ``solution`` is
``<answer>WORD</answer>``, what the accuracy reward reads.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 40),
}
KINDS = ("circle", "square", "triangle")
QUESTIONS = {
    "largest_colour": "Which colour is the largest shape?",
    "count_circles": "How many circles are there?",
    "square_side": "Is the square on the left or the right?",
}
# Every answer a question can have (a wrong answer is another of its question's).
ANSWERS = {
    "largest_colour": tuple(COLOURS),
    "count_circles": ("0", "1", "2", "3"),
    "square_side": ("left", "right"),
}
BACKGROUND = (255, 255, 255)


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    x: int  # centre
    y: int
    radius: int  # half the side of a square, the circumradius-ish extent of a triangle

    def box(self) -> tuple[int, int, int, int]:
        return (
            self.x - self.radius,
            self.y - self.radius,
            self.x + self.radius,
            self.y + self.radius,
        )


def scene(rng: random.Random, question: str, size: int) -> tuple[list[Shape], str]:
    """A scene for ``question`` (a key of QUESTIONS) on a ``size`` image, and its answer."""
    return _SCENES[question](rng, size)


def describe(shapes: list[Shape]) -> str:
    """A scene as text: what decides whether it is held out."""
    return ";".join(f"{s.kind},{s.colour},{s.x},{s.y},{s.radius}" for s in shapes)


def draw(scene: list[Shape], size: int) -> object:
    """The scene as an RGB PIL image."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), BACKGROUND)
    pen = ImageDraw.Draw(image)
    for shape in scene:
        fill = COLOURS[shape.colour]
        left, top, right, bottom = shape.box()
        if shape.kind == "circle":
            pen.ellipse((left, top, right, bottom), fill=fill)
        elif shape.kind == "square":
            pen.rectangle((left, top, right, bottom), fill=fill)
        else:
            pen.polygon([(shape.x, top), (right, bottom), (left, bottom)], fill=fill)
    return image


def _place(
    rng: random.Random, size: int, kinds: list[str], colours: list[str], radii: list[int]
) -> list[Shape]:
    """Shapes at random non-overlapping positions inside the image (rejection sampling)."""
    while True:
        placed: list[Shape] = []
        for kind, colour, radius in zip(kinds, colours, radii, strict=True):
            for _ in range(50):
                x = rng.randint(radius + 1, size - radius - 2)
                y = rng.randint(radius + 1, size - radius - 2)
                if all(
                    abs(x - o.x) > radius + o.radius + 1 or abs(y - o.y) > radius + o.radius + 1
                    for o in placed
                ):
                    placed.append(Shape(kind, colour, x, y, radius))
                    break
            else:
                break  # no room left: draw the scene again
        if len(placed) == len(kinds):
            return placed


def _radii(rng: random.Random, size: int, n: int) -> list[int]:
    low, high = max(3, size // 16), max(5, size // 6)
    return [rng.randint(low, high) for _ in range(n)]


def _largest_colour(rng: random.Random, size: int) -> tuple[list[Shape], str]:
    n = rng.randint(2, 3)
    low, high = max(3, size // 16), max(5, size // 6)
    # Distinct sizes, the largest clearly larger: a question a 64-pixel image can answer.
    sizes = range(low, high + 1, 2) if (high - low) // 2 + 1 >= 3 else range(low, high + 1)
    radii = sorted(rng.sample(sizes, n), reverse=True)
    colours = rng.sample(list(COLOURS), n)
    # One kind per scene: a larger box is then a larger area (a triangle fills half its box).
    scene = _place(rng, size, [rng.choice(KINDS)] * n, colours, radii)
    return scene, colours[0]


def _count_circles(rng: random.Random, size: int) -> tuple[list[Shape], str]:
    n = rng.randint(1, 4)
    circles = rng.randint(0, min(3, n))
    kinds = ["circle"] * circles + [rng.choice(("square", "triangle")) for _ in range(n - circles)]
    rng.shuffle(kinds)
    colours = [rng.choice(list(COLOURS)) for _ in range(n)]
    return _place(rng, size, kinds, colours, _radii(rng, size, n)), str(circles)


def _square_side(rng: random.Random, size: int) -> tuple[list[Shape], str]:
    n = rng.randint(1, 3)
    kinds = ["square"] + [rng.choice(("circle", "triangle")) for _ in range(n - 1)]
    colours = [rng.choice(list(COLOURS)) for _ in range(n)]
    while True:
        scene = _place(rng, size, kinds, colours, _radii(rng, size, n))
        square = scene[0]
        if abs(square.x - size / 2) >= size / 8:  # clearly on one side
            return scene, "left" if square.x < size / 2 else "right"


_SCENES = {
    "largest_colour": _largest_colour,
    "count_circles": _count_circles,
    "square_side": _square_side,
}
