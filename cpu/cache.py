"""Drops Numba's cached machine code of cpu/ when any cpu/*.py source changed.

Numba's `cache=True` checks only the cached function's own file, but the kernels here inline code
from other modules (cpu/i16.py's vector IR into cpu/expert.py, cpu/tiles_unrolled.py into
cpu/gemm.py): after an edit of i16.py, expert.py's cached phases would keep the old kernel.  So
`import cpu` hashes all cpu/*.py and, when the hash differs from the stamp beside the cache, deletes
the cache's index/data files (Numba recompiles on demand).  The cache directory is Numba's own
choice for this package (`__pycache__`, or under NUMBA_CACHE_DIR).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

STAMP = "cpu-sources.sha1"


def _anchor():   # a function of this package, to ask Numba where its caches live
    pass


def cache_dir() -> Path:
    from numba.core.caching import CacheImpl

    for cls in CacheImpl._locator_classes:          # the order Numba tries them in
        loc = cls.from_function(_anchor, __file__)
        if loc is not None:
            return Path(loc.get_cache_path())
    raise RuntimeError("no Numba cache locator for cpu/")


def sources_digest(here: Path | None = None) -> str:
    here = here or Path(__file__).parent
    h = hashlib.sha1()
    for p in sorted(here.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def drop_stale() -> bool:
    """Delete cpu/'s Numba cache files if the sources changed since they were stamped; True if so."""
    try:
        d = cache_dir()
    except Exception:        # no locator (read-only install...): Numba then does not cache either
        return False
    digest = sources_digest()
    stamp = d / STAMP
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass
    try:
        for f in list(d.glob("*.nbi")) + list(d.glob("*.nbc")):
            f.unlink(missing_ok=True)
        d.mkdir(parents=True, exist_ok=True)
        stamp.write_text(digest)
    except OSError:
        return False
    return True
