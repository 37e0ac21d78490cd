"""SASS figures per kernel entry, built here with NVRTC (no GPU): registers, instructions, the largest loop that holds
the entry's math (an MMA or FMA instruction) with its opcode counts, PRMTs, and local-memory loads / stores (spills).
With --base REV, the same entries built from git revision REV's cutlass_kernels too, side by side, and whether each
entry's SASS is the same instruction for instruction (labels and internal helper numbers aside): how a session
without a device reads what a kernel edit did (docs/PERF.md, session 32), or checks that a refactor changed nothing
(session 33).

    python3 tools/sass_loops.py moe_int4 --entry "moe_w4a16_kernel<0, 2, 4, 1, 1, 1>" --base e4262c6
    python3 tools/sass_loops.py dense_linear --entry gemv --top 12

Needs nvdisasm (runtime.cuda.nvrtc.find_disassembler: PATH, /usr/local/cuda/bin or the nvidia wheels).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b[^`]*`\((\.L_x_\d+)\)")
_MATH = re.compile(r"^(HMMA|HGMMA|IMMA|QMMA|FFMA|HFMA2|DFMA)\b")


def opcode(instruction: str) -> str:
    """'@!P0 HFMA2.BF16_V2 R0, ...' -> 'HFMA2' (the predicate and the modifiers dropped)."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


@dataclasses.dataclass
class EntryStats:
    registers: int | None
    instructions: int
    loop: int                # instructions of the largest loop holding a math instruction (0: none)
    loop_ops: Counter        # its opcodes
    prmt: int                # in the whole entry
    spills: int              # LDL + STL in the whole entry
    text: tuple[str, ...] = ()   # the instructions, label and internal-helper numbers erased (canonical)


def canonical(instructions: list[str]) -> tuple[str, ...]:
    """The instructions with what differs between two builds of the same code erased: branch label numbers
    (.L_x_12) and the numbers of NVRTC's internal helpers (__internal_4_$__cuda_sm20_rcp_rn_f32_slowpath)."""
    return tuple(re.sub(r"__internal_\d+_", "__internal_", re.sub(r"\.L_x_\d+", ".L_x", t)) for t in instructions)


def function_bodies(sass: str) -> dict[str, tuple[list[str], dict[str, int]]]:
    """nvdisasm text -> {symbol: (instructions in order, {label: index of the instruction it precedes})}."""
    out = {}
    for part in re.split(r"\n\s*\.section\s+\.text\.", sass)[1:]:
        symbol = part.split(",", 1)[0].strip()
        instructions, labels = [], {}
        for line in part.split("\n"):
            m = _INSTRUCTION.match(line)
            if m:
                instructions.append(m.group(2))
                continue
            m = _LABEL.match(line)
            if m:
                labels[m.group(1)] = len(instructions)
        out[symbol] = (instructions, labels)
    return out


def largest_math_loop(instructions: list[str], labels: dict[str, int]) -> list[str]:
    """The longest backward-branch range [label, branch] that holds an MMA / FMA instruction ([] if none)."""
    best: list[str] = []
    for i, text in enumerate(instructions):
        m = _BRANCH.search(text)
        if m and labels.get(m.group(1), i + 1) <= i:
            body = instructions[labels[m.group(1)]:i + 1]
            if len(body) > len(best) and any(_MATH.match(opcode(t)) for t in body):
                best = body
    return best


def entry_stats(sass: str, lowered: dict[str, str], registers: dict[str, int]) -> dict[str, EntryStats]:
    """Per registered entry (name expression -> mangled symbol in `lowered`)."""
    bodies = function_bodies(sass)
    out = {}
    for entry, symbol in lowered.items():
        if symbol not in bodies:
            continue
        instructions, labels = bodies[symbol]
        ops = Counter(opcode(t) for t in instructions)
        loop = largest_math_loop(instructions, labels)
        out[entry] = EntryStats(registers.get(entry), len(instructions), len(loop), Counter(opcode(t) for t in loop),
                                ops["PRMT"], ops["LDL"] + ops["STL"], canonical(instructions))
    return out


def build(family: str, arch: str, entries: tuple[str, ...], kernel_dir: Path | None = None) -> dict[str, EntryStats]:
    """Build `entries` of a registered family with NVRTC, from `kernel_dir` (another checkout's cutlass_kernels;
    None: this tree's), and read their SASS."""
    from cutlass_kernels.registry import FAMILIES
    from runtime.cuda import nvrtc
    fam = FAMILIES[family]
    here = str(nvrtc.kernel_source_dir())
    root = str(kernel_dir) if kernel_dir is not None else here
    source = Path(root) / fam.source
    spec = dataclasses.replace(fam, entries=entries)
    options = [o.replace(here, root) if o.startswith("-I") else o for o in nvrtc.build_options(spec, arch)]
    cubin, _, lowered, _ = nvrtc.nvrtc_compile(source.read_text(), fam.source, entries, options, family, arch)
    by_symbol = nvrtc.cubin_register_counts(cubin)
    registers = {e: by_symbol[s] for e, s in lowered.items() if s in by_symbol}
    return entry_stats(nvrtc.disassemble(cubin), lowered, registers)


def kernels_at(rev: str, into: Path) -> Path:
    """git revision `rev`'s cutlass_kernels, extracted under `into`."""
    repo = Path(__file__).resolve().parents[1]
    data = subprocess.run(["git", "-C", str(repo), "archive", rev, "cutlass_kernels"], capture_output=True,
                          check=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(into, filter="data")
    return into / "cutlass_kernels"


def registered_entries(kernel_dir: Path, family: str) -> set[str]:
    """The entries that family `family` registers in another checkout's cutlass_kernels/registry.py (loaded under
    its own module name): what a build of that revision can be asked for."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"_sass_loops_registry_{abs(hash(str(kernel_dir)))}",
                                                  kernel_dir / "registry.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    fam = module.FAMILIES.get(family)
    return set(fam.entries) if fam is not None else set()


def _row(s: EntryStats | None, top: int) -> str:
    if s is None:
        return "(not built)"
    ops = ", ".join(f"{k} {v}" for k, v in s.loop_ops.most_common(top))
    return f"{s.registers} regs, {s.instructions} instr, loop {s.loop}, PRMT {s.prmt}, spills {s.spills}: {ops}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="sass_loops", description=__doc__.split("\n\n")[0])
    ap.add_argument("family")
    ap.add_argument("--arch", default="90a")
    ap.add_argument("--entry", action="append", default=[],
                    help="an entry, or a substring of entries' names (repeatable; default: every entry)")
    ap.add_argument("--base", metavar="REV", help="also build the entries from this git revision's cutlass_kernels")
    ap.add_argument("--top", type=int, default=8, help="opcodes listed per loop")
    args = ap.parse_args(argv)
    from cutlass_kernels.registry import FAMILIES
    from runtime.cuda import nvrtc
    if args.family not in FAMILIES:
        raise SystemExit(f"sass_loops: unknown family {args.family!r}; registered: {', '.join(sorted(FAMILIES))}")
    if nvrtc.find_disassembler() is None:
        raise SystemExit("sass_loops: no nvdisasm found (PATH, /usr/local/cuda/bin, the nvidia wheels)")
    entries = tuple(e for e in FAMILIES[args.family].entries
                    if not args.entry or any(e == p or p in e for p in args.entry))
    if not entries:
        raise SystemExit(f"sass_loops: no entry of {args.family} matches {args.entry}")
    now = build(args.family, args.arch, entries)
    base = None
    if args.base:
        with tempfile.TemporaryDirectory() as tmp:
            kernel_dir = kernels_at(args.base, Path(tmp))
            known = registered_entries(kernel_dir, args.family)   # entries new since then are "not built" there
            old_entries = tuple(e for e in entries if e in known)
            base = build(args.family, args.arch, old_entries, kernel_dir) if old_entries else {}
    print(f"{args.family} sm_{args.arch}: registers, instructions, the largest loop holding the math "
          f"(instructions and opcodes), PRMT, LDL + STL")
    for e in entries:
        print(e)
        if base is not None:
            print(f"  {args.base[:12]:12s} {_row(base.get(e), args.top)}")
        print(f"  {'now':12s} {_row(now.get(e), args.top)}")
        if base is not None and e in base and e in now:
            print(f"  {'':12s} SASS {'the same' if base[e].text == now[e].text else 'differs'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
