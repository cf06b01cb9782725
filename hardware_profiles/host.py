"""What `plan profile` reads about the host without timing anything: RAM, CPU name, GPU topology.

`parse_nvidia_topo` reads the matrix printed by `nvidia-smi topo -m`; `link_kind_from_topo` turns it into the
intra-node link kind of a profile (NVLink/NVSwitch when every GPU pair is joined by NV#, else PCIe).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as {key: bytes} (MemTotal, MemAvailable, ...)."""
    out: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        m = re.match(r"(\w+):\s+(\d+)\s*(kB)?", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    return out


def cpu_name(path: str = "/proc/cpuinfo") -> str:
    """The CPU model name, or `cpu` where /proc/cpuinfo does not say."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


_CONNECTION = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)$")


def parse_nvidia_topo(text: str) -> dict[tuple[int, int], str]:
    """{(i, j): connection} for GPU pairs i < j from `nvidia-smi topo -m` output (NV#, PIX, PXB, PHB, NODE, SYS)."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    def is_header(ln: str) -> bool:  # column titles "GPU0 GPU1 ..."; a row is "GPU0 X NV12 ..."
        cells = ln.split()
        return "GPU0" in cells and not (len(cells) > 1 and _CONNECTION.match(cells[1]))
    header = next((ln for ln in lines if is_header(ln)), None)
    if header is None:
        raise ValueError("no GPU header row in the nvidia-smi topo -m output")
    columns = header.split()
    gpu_cols = [i for i, c in enumerate(columns) if re.fullmatch(r"GPU\d+", c)]
    pairs: dict[tuple[int, int], str] = {}
    for ln in lines:
        cells = ln.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        i = int(cells[0][3:])
        values = cells[1:]
        for k, col in enumerate(gpu_cols):
            if k >= len(values) or not _CONNECTION.match(values[k]):
                break
            j = int(columns[col][3:])
            if i < j:
                pairs[(i, j)] = values[k]
    return pairs


def link_kind_from_topo(pairs: dict[tuple[int, int], str], gpus: int) -> str:
    """`nvswitch` (all pairs NV#, more than 2 GPUs), `nvlink` (2 GPUs on NV#), or `pcie` (any pair without NVLink)."""
    if gpus < 2:
        return "pcie"
    every = [pairs.get((i, j), "SYS") for i in range(gpus) for j in range(i + 1, gpus)]
    if all(c.startswith("NV") for c in every):
        return "nvswitch" if gpus > 2 else "nvlink"
    return "pcie"


def nvidia_topo_text() -> str | None:
    """Output of `nvidia-smi topo -m`, or None where nvidia-smi is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def gpu_link_kind(gpus: int) -> str:
    """Intra-node link kind of this host's GPUs, from `nvidia-smi topo -m` (pcie where it cannot be read)."""
    text = nvidia_topo_text()
    if text is not None:
        try:
            return link_kind_from_topo(parse_nvidia_topo(text), gpus)
        except ValueError:
            pass
    # Without nvidia-smi, CUDA peer access cannot tell NVLink from PCIe (P2P works over both): say pcie, the
    # conservative kind; the measured bandwidth in the profile is what the cost model uses either way.
    return "pcie"
