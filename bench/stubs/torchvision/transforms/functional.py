"""Stand-in: ``streaming.vision.base`` imports to_tensor; the benchmark never calls it."""

from typing import Any


def to_tensor(pic: Any) -> Any:
    raise NotImplementedError("torchvision stand-in (bench/stubs): not available here")
