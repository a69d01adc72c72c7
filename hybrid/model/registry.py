"""Model names users can type instead of a folder: `tiny` is the embedded model."""
from __future__ import annotations

from pathlib import Path

from hybrid.errors import CheckpointError

ASSETS = Path(__file__).resolve().parent.parent / "assets"
EMBEDDED = {"tiny": ASSETS / "tiny"}


def resolve_model_path(name_or_path: str | Path | None) -> Path:
    """None or 'tiny' -> the embedded model folder; otherwise the given folder."""
    key = "tiny" if name_or_path is None else str(name_or_path)
    if key in EMBEDDED:
        path = EMBEDDED[key]
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: the embedded model {key!r} is not installed with this package")
        return path
    path = Path(key).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: model folder not found")
    return path
