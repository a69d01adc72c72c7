"""Files written whole or not at all."""
from __future__ import annotations

import os
from pathlib import Path

from hybrid.errors import HybridError


def write_text_atomic(path: str | Path, text: str, flag: str) -> Path:
    """text into path through a temporary file beside it, renamed over it: a reader (a dashboard, the next
    run) never sees half a file, and a failed write leaves neither half a file nor the temporary one; an
    OSError is one line naming the flag and the path."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        raise HybridError(f"{flag} {path}: cannot write ({exc.strerror})") from None
    finally:
        if tmp.is_file():
            tmp.unlink()
    return path
