"""Result-record plumbing for the baseline benchmarks: machine, git sha, command, sizes, JSONL."""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import struct
import subprocess
import sys
from pathlib import Path

MIB = 2**20


def git_sha(short: bool = True, dirty: bool = True) -> str:
    """HYBRID_GIT_SHA when set (a device copy of the tree: its .git, if any, is not this tree's);
    else HEAD's sha (`short`: 7 hex digits; `dirty`: "+dirty" when tracked files differ), else
    "unknown"."""
    env = os.environ.get("HYBRID_GIT_SHA", "")
    if env:
        return env[:7] if short else env
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", *(["--short"] if short else []), "HEAD"], capture_output=True,
                             text=True, cwd=here, timeout=10)
        sha = out.stdout.strip()
        if sha and dirty:
            sha += "+dirty" if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                              capture_output=True, text=True, cwd=here,
                                              timeout=10).stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return sha or "unknown"


def machine() -> str:
    """One line: CPU model, cores, RAM, OS, python."""
    import psutil

    from hybrid.hardware import detect_cpu

    ram = f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM"
    return f"{detect_cpu().model}, {os.cpu_count()} logical cores, {ram}, {platform.system()} {platform.release()}, " \
           f"python {platform.python_version()}"


def command_line(prog: str | None = None) -> str:
    """The command as typed; `prog` replaces argv[0] (e.g. when run as `python -m ...`)."""
    return " ".join(shlex.quote(a) for a in [prog or Path(sys.argv[0]).name] + sys.argv[1:])


def stamp(prog: str | None = None) -> dict:
    return {"time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git_sha": git_sha(), "machine": machine(), "command": command_line(prog)}


def append_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=True) + "\n")


def folder_bytes(folder: Path) -> int:
    """Download size of a HF checkpoint: its safetensors files."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def _safetensors_entries(path: Path) -> dict:
    with path.open("rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def checkpoint_expert_bytes(folder: Path) -> int:
    """Bytes of every stored expert tensor (weights + scales) in a HF checkpoint."""
    total = 0
    for f in Path(folder).glob("*.safetensors"):
        for name, meta in _safetensors_entries(f).items():
            if name != "__metadata__" and ".mlp.experts." in name:
                a, b = meta["data_offsets"]
                total += b - a
    return total


def gguf_expert_bytes(path: Path) -> int:
    """Bytes of the stacked expert tensors (blk.N.ffn_*_exps.*) in a GGUF."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return int(sum(t.n_bytes for t in reader.tensors if "_exps." in t.name))
