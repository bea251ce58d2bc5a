"""The pictures of the recorded image run (record_traces.py's multimodal): drawn, not photographed, so that
they are small, the same on every machine, and tell apart at a glance in the notebook that shows them.

    picture("red-circle")  ->  PNG bytes;  data_url("red-circle")  ->  "data:image/png;base64,..."

Each is a few shapes on a plain ground, of a size of its own (the processor resizes and crops every one
to 224x224, so each costs the same 256 placeholder tokens whatever its size).
"""

import base64
import io

# name -> (width, height, ground, [(shape, box as fractions of the size, colour)])
PICTURES = {
    "red-circle": (320, 240, "white", [("ellipse", (0.3, 0.2, 0.7, 0.8), "red")]),
    "blue-square": (200, 200, "lightyellow", [("rectangle", (0.25, 0.25, 0.75, 0.75), "blue")]),
    "green-stripes": (400, 300, "white", [("rectangle", (0, y / 6, 1, y / 6 + 1 / 12), "green") for y in range(6)]),
    "sunset": (480, 270, "orange", [("ellipse", (0.35, 0.45, 0.65, 0.95), "yellow"),
                                    ("rectangle", (0, 0.7, 1, 1), "darkblue")]),
    "checkers": (256, 256, "white", [("rectangle", (x / 4, y / 4, x / 4 + 0.25, y / 4 + 0.25), "black")
                                     for x in range(4) for y in range(4) if (x + y) % 2]),
    "two-dots": (300, 200, "lightgrey", [("ellipse", (0.1, 0.3, 0.4, 0.7), "purple"),
                                         ("ellipse", (0.6, 0.3, 0.9, 0.7), "teal")]),
    "house": (240, 320, "skyblue", [("rectangle", (0.2, 0.5, 0.8, 1), "brown"),
                                    ("polygon", (0.1, 0.5, 0.5, 0.2, 0.9, 0.5), "darkred")]),
    "warm-up": (64, 64, "grey", []),  # the warm-up request's, dropped from the run with it
}


def picture(name: str) -> bytes:
    """The named picture as PNG bytes."""
    from PIL import Image, ImageDraw

    width, height, ground, shapes = PICTURES[name]
    image = Image.new("RGB", (width, height), ground)
    draw = ImageDraw.Draw(image)
    for shape, box, colour in shapes:
        points = [v * (width if i % 2 == 0 else height) for i, v in enumerate(box)]
        getattr(draw, shape)(points if shape == "polygon" else [round(p) for p in points], fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode(picture(name)).decode()
