"""Hardware profiles: JSON files that stand in for detection, so a rig can be planned from anywhere.

Units: memory in MiB / GiB (2**20 / 2**30 bytes, as nvidia-smi and llama.cpp print them);
bandwidths in GB/s (1e9 bytes/s); times in microseconds.

Every speed figure is a `Figure`: {"value": 12.0, "source": "measured"|"assumed", "note": "..."}.
"measured" means `hybrid-bench calibrate` wrote it on that machine; "assumed" figures must say
where they come from in `note`. See profiles/README.md for the full format.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any

from hybrid.errors import HybridError

SCHEMA = 1
SOURCES = ("measured", "assumed")


class ProfileError(HybridError):
    """A hardware or expert-popularity profile is missing or malformed."""


@dataclass(frozen=True)
class Figure:
    """One number with where it came from."""

    value: float
    source: str
    note: str = ""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if not (isinstance(self.value, (int, float)) and self.value > 0):
            raise ValueError(f"value must be a positive number, got {self.value!r}")
        if self.source == "assumed" and not self.note.strip():
            raise ValueError("an assumed figure needs a note saying where it comes from")


@dataclass(frozen=True)
class GPUProfile:
    """One GPU. read_gbs: large read-only reduction; copy_gbs: device copy, read+write counted;
    kernel_efficiency: fraction of read_gbs that the QPN decode kernels reach;
    h2d/d2h: pinned host<->device copies; context_mib: CUDA context + runtime reserve;
    graph_kernel_us: GPU time of one small kernel inside a CUDA graph (the fixed cost each of a
    layer's ~40 kernels pays whatever its bytes); launch_us: host time to issue one eager op;
    attn_kv_gbs: bytes of K and V per second that the one-token attention reads as its keys grow (a
    graphed decode step's attention, Qwen3-30B-A3B's heads: the time per extra key), absent in
    older profiles (the planner then reads the KV cache at kernel_bytes_per_s);
    dense_gemv_gbs: bytes per second of an unquantized fp16 weight in a one-token matmul (torch /
    cuBLAS: the lm_head that NVFP4 checkpoints keep in BF16), absent in older profiles (the planner
    then reads it at kernel_bytes_per_s);
    fused_layer_us: GPU µs per decode layer of the fused norm, q/k norm + RoPE + attention and add + norm +
    router kernels between the layer's QPN kernels, launched as the runtime launches them (calibrate: a CUDA
    graph of decode layers with them against one without), absent in older profiles (the planner then
    charges the dense part of a layer as step_shape's dense_kernels small kernels of graph_kernel_us)."""

    name: str
    compute_capability: str
    memory_mib: int
    pcie_gen: int
    pcie_width: int
    read_gbs: Figure
    copy_gbs: Figure
    kernel_efficiency: Figure
    h2d_gbs: Figure
    d2h_gbs: Figure
    context_mib: Figure
    graph_kernel_us: Figure
    launch_us: Figure
    attn_kv_gbs: Figure | None = None
    dense_gemv_gbs: Figure | None = None
    fused_layer_us: Figure | None = None

    def __post_init__(self) -> None:
        if self.memory_mib <= 0:
            raise ValueError(f"memory_mib must be positive, got {self.memory_mib}")
        if self.kernel_efficiency.value > 1.0:
            raise ValueError(f"kernel_efficiency is a fraction (0, 1], got {self.kernel_efficiency.value}")

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * 2**20

    @property
    def kernel_bytes_per_s(self) -> float:
        """Bytes/s the QPN kernels read on decode shapes."""
        return self.read_gbs.value * self.kernel_efficiency.value * 1e9

    @property
    def kv_bytes_per_s(self) -> float:
        """Bytes/s of KV cache the decode attention reads per extra key (kernel_bytes_per_s if unmeasured)."""
        return self.attn_kv_gbs.value * 1e9 if self.attn_kv_gbs is not None else self.kernel_bytes_per_s

    @property
    def dense_bytes_per_s(self) -> float:
        """Bytes/s of an unquantized weight in a one-token matmul (kernel_bytes_per_s if unmeasured)."""
        return self.dense_gemv_gbs.value * 1e9 if self.dense_gemv_gbs is not None else self.kernel_bytes_per_s

    @property
    def link_bytes_per_s(self) -> float:
        """The slower direction of the PCIe link, bytes/s."""
        return min(self.h2d_gbs.value, self.d2h_gbs.value) * 1e9


@dataclass(frozen=True)
class CPUProfile:
    """stream_copy_gbs: STREAM-like copy, read+write counted, all cores;
    nvfp4_kernel_gbs: packed expert bytes (+ scales) the CPU kernels consume per second at M = 1;
    nvfp4_m8_ratio: time of one call with M = 8 rows per expert over one with M = 1, same experts,
    all cores (how the CPU's cost grows with a prefill step's rows: hybrid.planner.prefill); absent
    in older profiles (the planner then uses prefill.DEFAULT_M8_RATIO)."""

    model: str
    physical_cores: int
    avx2: bool
    avx512: bool | None
    stream_copy_gbs: Figure
    nvfp4_kernel_gbs: Figure
    nvfp4_m8_ratio: Figure | None = None

    def __post_init__(self) -> None:
        if self.physical_cores <= 0:
            raise ValueError(f"physical_cores must be positive, got {self.physical_cores}")
        if self.avx512 not in (True, False, None):
            raise ValueError(f"avx512 must be true, false or null (unknown), got {self.avx512!r}")


@dataclass(frozen=True)
class HostProfile:
    """ram_usable_gib: RAM hybrid may use; hugepages_2m_total: 2 MiB pages reserved (vm.nr_hugepages);
    reserve_gib: RAM kept for the OS, Python and torch."""

    ram_usable_gib: float
    hugepages_2m_total: int = 0
    reserve_gib: float = 4.0

    def __post_init__(self) -> None:
        if self.ram_usable_gib <= 0 or self.reserve_gib < 0 or self.hugepages_2m_total < 0:
            raise ValueError("ram_usable_gib must be positive, reserve_gib and hugepages_2m_total >= 0")


@dataclass(frozen=True)
class Overheads:
    """Host costs. layer_sync_us: router ids (+ x) to the host, once per layer that can miss;
    lookup_us: the expert cache's lookup of one layer's routed ids (every layer on a card: at once
    where it can miss, deferred to the step's end where it is fully resident);
    cpu_dispatch_us: hand a layer's misses to the CPU pool and collect them;
    token_us: per token outside the layers (embed, graph replays, sampler, Python);
    link_us: the host's round trip of a can-miss layer whose hits run inside the decode graph
    (hybrid.runtime.miss_link: replay, wait for the routed row, upload the CPU's sum), which
    replaces layer_sync_us and the eager ops on that path; absent in older profiles (the planner
    then charges that path as eager ops);
    hop_us: what one crossing of a decode step between two physical GPUs adds to the token (the
    wait of one card's stream for the other's, the peer copy, the next graph's start), measured
    against the same work on one GPU; absent in older profiles and on one-GPU machines (the
    planner then charges the receiving card's launch_us per crossing)."""

    layer_sync_us: Figure
    cpu_dispatch_us: Figure
    token_us: Figure
    lookup_us: Figure
    link_us: Figure | None = None
    hop_us: Figure | None = None


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    gpus: tuple[GPUProfile, ...]
    cpu: CPUProfile
    host: HostProfile
    overheads: Overheads
    path: str = field(default="", compare=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("path")
        d["gpus"] = list(d["gpus"])
        for section, key in (("overheads", "link_us"), ("overheads", "hop_us"), ("cpu", "nvfp4_m8_ratio")):
            if d[section][key] is None:                # older profiles: leave the key out
                del d[section][key]
        for g in d["gpus"]:
            for key in ("attn_kv_gbs", "dense_gemv_gbs", "fused_layer_us"):
                if g[key] is None:                     # older profiles: leave the key out
                    del g[key]
        return {"schema": SCHEMA, **d}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @property
    def assumed(self) -> list[str]:
        """Dotted names of the figures that were not measured."""
        return [k for k, f in _figures(self.to_dict()) if f["source"] == "assumed"]


def _figures(d: Any, prefix: str = ""):
    if isinstance(d, dict) and "source" in d and "value" in d:
        yield prefix, d
    elif isinstance(d, dict):
        for k, v in d.items():
            yield from _figures(v, f"{prefix}.{k}" if prefix else k)
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from _figures(v, f"{prefix}[{i}]")


# ---------------------------------------------------------------- parsing with clear errors

def _build(cls, d: Any, where: str):
    """cls(**d) with each figure field parsed; unknown or missing keys are errors."""
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: expected a JSON object, got {type(d).__name__}")
    fields = {n: f for n, f in cls.__dataclass_fields__.items() if n != "path"}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ProfileError(f"{where}: unknown key {unknown[0]!r}; expected {', '.join(fields)}")
    missing = [n for n, f in fields.items() if n not in d and f.default is MISSING]
    if missing:
        raise ProfileError(f"{where}: missing key {missing[0]!r}")
    # Fields annotated `Figure` (a string under `from __future__ import annotations`) are figures.
    kw = {k: _figure(v, f"{where}.{k}") if fields[k].type in FIGURE_TYPES and (v is not None or
                                              fields[k].default is MISSING) else v for k, v in d.items()}
    try:
        return cls(**kw)
    except ValueError as exc:
        raise ProfileError(f"{where}: {exc}") from None


FIGURE_TYPES = ("Figure", Figure, "Figure | None")


def _figure(v: Any, where: str) -> Figure:
    if not isinstance(v, dict) or "value" not in v or "source" not in v:
        raise ProfileError(f"{where}: expected {{\"value\": N, \"source\": \"measured\"|\"assumed\", "
                           f"\"note\": \"...\"}}, got {json.dumps(v)[:60]}")
    extra = set(v) - {"value", "source", "note"}
    if extra:
        raise ProfileError(f"{where}: unknown key {sorted(extra)[0]!r} in a figure")
    try:
        return Figure(v["value"], v["source"], v.get("note", ""))
    except ValueError as exc:
        raise ProfileError(f"{where}: {exc}") from None


_TYPES = {"name": str, "description": str, "compute_capability": str, "model": str,
          "memory_mib": int, "pcie_gen": int, "pcie_width": int, "physical_cores": int,
          "hugepages_2m_total": int, "avx2": bool, "ram_usable_gib": (int, float),
          "reserve_gib": (int, float)}


def _check_types(d: Any, where: str) -> None:
    if isinstance(d, dict):
        for k, v in d.items():
            t = _TYPES.get(k)
            bad = t is not None and (not isinstance(v, t) or (t is int and isinstance(v, bool)))
            if bad:
                raise ProfileError(f"{where}.{k}: expected {getattr(t, '__name__', 'a number')}, "
                                   f"got {json.dumps(v)}")
            _check_types(v, f"{where}.{k}")
    elif isinstance(d, list):
        for i, v in enumerate(d):
            _check_types(v, f"{where}[{i}]")


def profile_from_dict(d: Any, where: str = "profile") -> HardwareProfile:
    """Validate and build a HardwareProfile from parsed JSON."""
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: expected a JSON object")
    if d.get("schema") != SCHEMA:
        raise ProfileError(f"{where}: schema must be {SCHEMA}, got {d.get('schema')!r}")
    top = ("schema", "name", "description", "gpus", "cpu", "host", "overheads")
    unknown = sorted(set(d) - set(top))
    if unknown:
        raise ProfileError(f"{where}: unknown key {unknown[0]!r}; expected {', '.join(top)}")
    for k in top:
        if k not in d:
            raise ProfileError(f"{where}: missing key {k!r}")
    _check_types(d, where)
    if not isinstance(d["gpus"], list):
        raise ProfileError(f"{where}.gpus: expected a list (empty for a CPU-only machine)")
    gpus = tuple(_build(GPUProfile, g, f"{where}.gpus[{i}]") for i, g in enumerate(d["gpus"]))
    return HardwareProfile(
        name=d["name"], description=d["description"], gpus=gpus,
        cpu=_build(CPUProfile, d["cpu"], f"{where}.cpu"),
        host=_build(HostProfile, d["host"], f"{where}.host"),
        overheads=_build(Overheads, d["overheads"], f"{where}.overheads"),
    )


# ---------------------------------------------------------------- finding profiles

def profile_dirs() -> list[Path]:
    """Where profiles are looked up by name, in order: ./profiles (the working directory), the
    repository's profiles/ (source checkout / editable install), the copy shipped in the package."""
    pkg = Path(__file__).resolve().parent
    dirs = [Path.cwd() / "profiles", pkg.parents[1] / "profiles", pkg / "profiles"]
    out: list[Path] = []
    for d in dirs:
        if d.is_dir() and all(d.resolve() != o.resolve() for o in out):
            out.append(d)
    return out


def find_profile_file(name_or_file: str) -> Path:
    """A path to an existing file, or a name looked up as NAME.json in profile_dirs()."""
    p = Path(name_or_file)
    if p.is_file():
        return p
    if p.suffix == ".json" or len(p.parts) > 1:
        raise ProfileError(f"{name_or_file}: no such profile file")
    for d in profile_dirs():
        cand = d / f"{name_or_file}.json"
        if cand.is_file():
            return cand
    known = list_profiles()
    raise ProfileError(f"--profile {name_or_file}: no profile of that name; known: "
                       f"{', '.join(known) or 'none'} (or give a path to a .json file)")


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read ({exc.strerror})") from None


def load_profile(name_or_file: str) -> HardwareProfile:
    """Load a hardware profile by name (profiles/NAME.json) or path; validates it."""
    path = find_profile_file(name_or_file)
    prof = profile_from_dict(read_json(path), str(path))
    return HardwareProfile(**{**prof.__dict__, "path": str(path)})


def list_profiles() -> list[str]:
    """Names of the hardware profiles that load_profile finds."""
    return sorted({f.stem for d in profile_dirs() for f in d.glob("*.json")
                   if not f.name.endswith(".experts.json")})


# ---------------------------------------------------------------- a shipped profile for another machine
def _cc(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


def nearest_profile(profiles: list[HardwareProfile], compute_capability: str, n_gpus: int) -> HardwareProfile | None:
    """The profile whose GPUs are closest to a GPU of this compute capability ("7.0"): the same, else the
    nearest (an older architecture before a newer one at equal distance), then the one whose GPU count is
    nearest n_gpus. None where no profile has a GPU."""
    want = _cc(compute_capability)

    def key(p: HardwareProfile):
        have = _cc(p.gpus[0].compute_capability)
        dist = abs((have[0] - want[0]) * 10 + have[1] - want[1])
        return dist, have > want, abs(len(p.gpus) - n_gpus), p.name

    with_gpus = [p for p in profiles if p.gpus]
    return min(with_gpus, key=key) if with_gpus else None


def _borrowed(fig: Figure | None, base: str) -> Figure | None:
    if fig is None:
        return None
    note = f"{base}'s {fig.source} figure, not this machine's" + (f" ({fig.note})" if fig.note else "")
    return Figure(fig.value, "assumed", note)


def _borrow_all(obj, base: str):
    """obj with each of its Figure fields marked as borrowed from profile `base`."""
    return type(obj)(**{k: _borrowed(v, base) if isinstance(v, Figure) else v for k, v in obj.__dict__.items()})


def adapt_profile(base: HardwareProfile, gpus: list[tuple[str, str, int]], ram_usable_gib: float,
                  cpu_model: str, physical_cores: int, avx2: bool, avx512: bool | None,
                  hugepages_2m_total: int = 0) -> HardwareProfile:
    """base's speed figures for another machine: its GPUs (name, compute capability, memory MiB; by CUDA
    ordinal), RAM and CPU are this machine's, so a plan fits it; every speed figure stays base's, marked
    assumed (`hybrid-bench calibrate` measures them)."""
    if not gpus:
        raise ValueError("adapt_profile: no GPU given")
    b = base.name
    cards = tuple(type(g)(**{**_borrow_all(g, b).__dict__, "name": name, "compute_capability": cc,
                             "memory_mib": int(mib)})
                  for g, (name, cc, mib) in ((base.gpus[min(i, len(base.gpus) - 1)], spec)
                                             for i, spec in enumerate(gpus)))
    cpu = type(base.cpu)(**{**_borrow_all(base.cpu, b).__dict__, "model": cpu_model,
                            "physical_cores": int(physical_cores), "avx2": bool(avx2), "avx512": avx512})
    host = HostProfile(ram_usable_gib=round(ram_usable_gib, 1), hugepages_2m_total=int(hugepages_2m_total),
                       reserve_gib=base.host.reserve_gib)
    names = ", ".join(sorted({g[0] for g in gpus}))
    return HardwareProfile(name=f"{b}@this-machine", description=f"{b}'s speed figures for {len(gpus)} x {names} "
                           f"and {cpu_model} (sizes this machine's; run hybrid-bench calibrate to measure it)",
                           gpus=cards, cpu=cpu, host=host, overheads=_borrow_all(base.overheads, b))
