"""`data=shapes`: generated image-caption pairs, no network and no image library.

Each image is a small RGB array with one shape (4 kinds x 6 colours x 4 places x 2 sizes = 192
captions) drawn on dark noise, at a slightly jittered spot; its caption names exactly those four
attributes ("small red circle, top left."). Images are stored with Hugging Face `datasets`
`Array3D` features, so they travel the same way a real image dataset would.

Because the generator knows the answer, the loss floors are exact, as for the Markov source:
a model that cannot see the image can do no better than spreading the caption over all 192 (each
caption is drawn uniformly, so it pays log 192 per caption, the rest of the text being
determined), and one that sees it can reach ~0. Loss is taken on caption tokens only.
"""

from __future__ import annotations

import math

import numpy as np

SHAPES = ("square", "circle", "triangle", "cross")
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 235),
    "yellow": (230, 215, 40),
    "purple": (170, 60, 210),
    "white": (240, 240, 240),
}
PLACES = (("top", "left"), ("top", "right"), ("bottom", "left"), ("bottom", "right"))
SIZES = ("small", "large")
NUM_CAPTIONS = len(SHAPES) * len(COLOURS) * len(PLACES) * len(SIZES)


def caption(shape: str, colour: str, place: tuple[str, str], size: str) -> str:
    return f"{size} {colour} {shape}, {place[0]} {place[1]}."


def _shape_mask(shape: str, dy: np.ndarray, dx: np.ndarray, radius: float) -> np.ndarray:
    if shape == "square":
        return (np.abs(dy) <= radius) & (np.abs(dx) <= radius)
    if shape == "circle":
        return dy**2 + dx**2 <= radius**2
    if shape == "triangle":  # pointing up: wider towards the bottom
        return (np.abs(dy) <= radius) & (np.abs(dx) <= (dy + radius) / 2)
    bar = radius / 3  # cross
    return ((np.abs(dx) <= bar) & (np.abs(dy) <= radius)) | (
        (np.abs(dy) <= bar) & (np.abs(dx) <= radius)
    )


def render(
    shape: str,
    colour: str,
    place: tuple[str, str],
    size: str,
    image_size: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """[image_size, image_size, 3] uint8: the shape in its quadrant, jittered by up to a pixel,
    on dark noise."""
    image = rng.integers(0, 30, size=(image_size, image_size, 3), dtype=np.uint8)
    quadrant = image_size / 2
    radius = quadrant * (0.22 if size == "small" else 0.42)
    cy = quadrant * (0.5 if place[0] == "top" else 1.5) + rng.uniform(-1, 1)
    cx = quadrant * (0.5 if place[1] == "left" else 1.5) + rng.uniform(-1, 1)
    yy, xx = np.mgrid[0:image_size, 0:image_size].astype(np.float64) + 0.5
    mask = _shape_mask(shape, yy - cy, xx - cx, radius)
    image[mask] = COLOURS[colour]
    return image


def shapes_dataset(num_samples: int, image_size: int, seed: int):
    """A `datasets.Dataset` of `num_samples` seeded pairs: columns image (Array3D uint8) and
    caption; every attribute drawn uniformly and independently."""
    import datasets

    rng = np.random.default_rng(seed)
    images, captions = [], []
    for _ in range(num_samples):
        shape = SHAPES[rng.integers(len(SHAPES))]
        colour = list(COLOURS)[rng.integers(len(COLOURS))]
        place = PLACES[rng.integers(len(PLACES))]
        size = SIZES[rng.integers(len(SIZES))]
        images.append(render(shape, colour, place, size, image_size, rng))
        captions.append(caption(shape, colour, place, size))
    features = datasets.Features(
        {
            "image": datasets.Array3D(shape=(image_size, image_size, 3), dtype="uint8"),
            "caption": datasets.Value("string"),
        }
    )
    return datasets.Dataset.from_dict(
        {"image": np.stack(images), "caption": captions}, features=features
    )


def blind_floor(num_captions: int, predicted_tokens: int) -> float:
    """Mean loss per predicted caption token of the best model that cannot see the images:
    log(NUM_CAPTIONS) per caption, the rest of each caption being determined by its words."""
    return num_captions * math.log(NUM_CAPTIONS) / predicted_tokens
