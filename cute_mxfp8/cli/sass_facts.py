"""Facts about a compiled kernel read from its CUBIN (no tools needed) and its SASS (needs ``nvdisasm``).

* :func:`cubin_resources`: per kernel in the CUBIN (an ELF file), the registers per thread (``EIATTR_REGCOUNT``),
  the local-memory frame per thread (``EIATTR_FRAME_SIZE``; non-zero means spills or local arrays) and the static
  shared memory (size of the ``.nv.shared.<kernel>`` section).
* :func:`disassemble` runs ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel of the ``sass`` extra, else a CUDA
  toolkit's) and :func:`opcode_counts` counts the SASS instructions by full opcode (``LDG.E.128``, ``F2FP...``).
"""

from __future__ import annotations

import collections
import functools
import os
import pathlib
import re
import shutil
import struct
import subprocess
import tempfile

_EIATTR_FRAME_SIZE = 0x11
_EIATTR_REGCOUNT = 0x2F
_EIFMT_SVAL = 0x04
# one SASS instruction: "/*0040*/  @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;" -> "LDG.E.128"; modifiers may hold
# lower case ("QGMMA.64x96x32.F32.E4M3.E4M3" keeps its MMA shape)
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)", re.M)


def _sections(elf: bytes) -> dict[str, tuple[int, int, int, int]]:
    """name -> (type, offset, size, link) of each section of a little-endian ELF64 file."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a little-endian ELF64 file (a CUBIN is one)")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQII", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(offset):
        return elf[names_at + offset:elf.index(b"\0", names_at + offset)].decode()

    return {name(h[0]): (h[1], h[4], h[5], h[6]) for h in headers}


def _symbol_names(elf: bytes, sections: dict) -> list[str]:
    _, offset, size, _ = sections[".symtab"]
    strtab = sections[".strtab"][1]
    names = []
    for i in range(size // 24):
        st_name, = struct.unpack_from("<I", elf, offset + 24 * i)
        names.append(elf[strtab + st_name:elf.index(b"\0", strtab + st_name)].decode())
    return names


def cubin_resources(cubin: bytes) -> dict[str, dict[str, int]]:
    """``{kernel: {"regs": n, "local_frame": bytes, "smem_static": bytes}}`` for every kernel in ``cubin``."""
    sections = _sections(cubin)
    symbols = _symbol_names(cubin, sections)
    kernels = {name[len(".text."):]: {"regs": 0, "local_frame": 0, "smem_static": 0}
               for name in sections if name.startswith(".text.")}
    for name, (_, offset, size, _) in sections.items():
        if name.startswith(".nv.shared.") and name[len(".nv.shared."):] in kernels:
            kernels[name[len(".nv.shared."):]]["smem_static"] = size
        if not name.startswith(".nv.info"):
            continue
        pos = offset
        while pos + 4 <= offset + size:  # records: format u8, attribute u8, then u16 (payload size for SVAL)
            fmt, attr, value = struct.unpack_from("<BBH", cubin, pos)
            pos += 4
            if fmt != _EIFMT_SVAL:
                continue
            if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and value == 8:
                sym, amount = struct.unpack_from("<II", cubin, pos)
                if symbols[sym] in kernels:
                    kernels[symbols[sym]]["regs" if attr == _EIATTR_REGCOUNT else "local_frame"] = amount
            pos += value
    return kernels


@functools.lru_cache(maxsize=None)
def find_nvdisasm() -> str | None:
    """Path of a usable ``nvdisasm``: the one the DSL would use for ``KeepSASS``, else one on ``PATH``."""
    try:
        from cutlass.base_dsl.env_manager import _find_nvdisasm_binary  # the DSL's own search and version check

        return _find_nvdisasm_binary()
    except Exception:  # noqa: BLE001 -- not found, too old, or the DSL moved the helper: look on PATH
        return shutil.which("nvdisasm")


def disassemble(cubin: bytes) -> str:
    """SASS of the code sections of ``cubin`` (``nvdisasm -c -ndf``); raises if no ``nvdisasm`` is found."""
    tool = find_nvdisasm()
    if tool is None:
        raise FileNotFoundError("nvdisasm not found: pip install -e \".[sass]\"")
    with tempfile.TemporaryDirectory(prefix="cute_mxfp8_sass_") as tmp:
        path = pathlib.Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        res = subprocess.run([tool, "-c", "-ndf", os.fspath(path)], capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"nvdisasm failed ({res.returncode}): {res.stderr.strip()[:300]}")
    return res.stdout


def opcode_counts(sass: str) -> collections.Counter:
    """Number of instructions per full opcode (predicates dropped, modifiers kept) in ``sass``."""
    return collections.Counter(_INSTRUCTION.findall(sass))


_LINE = re.compile(r"^\s*(?:(\.L_x_\d+):|/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;)", re.M)
_BACK_TARGET = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")


def loop_bodies(sass: str) -> list[list[str]]:
    """The instruction lists of the loops in ``sass`` (one kernel's listing): each backward branch to a label
    closes a loop whose body runs from that label to the branch, inclusive.  Nested loops appear once each."""
    instructions: list[str] = []
    labels: dict[str, int] = {}
    for label, instruction in _LINE.findall(sass):
        if label:
            labels[label] = len(instructions)
        else:
            instructions.append(instruction)
    loops = []
    for end, instruction in enumerate(instructions):
        target = _BACK_TARGET.search(instruction)
        if target and labels.get(target.group(1), end + 1) <= end:
            loops.append(instructions[labels[target.group(1)]:end + 1])
    return loops
