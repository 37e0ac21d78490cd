"""NVRTC builds of the kernel families in cutlass_kernels/, to CUBIN, with an on-disk cache.

Cache key = sha256 of: the source and every header it can reach (found by scanning #include lines, a
superset of what the preprocessor takes), the entry names, the options, the NVRTC version and the arch.
Layout: $DDTREE_KERNEL_CACHE or ~/.cache/ddtree/kernels / <nvrtc major.minor> / <arch> / <key>.cubin, plus
<key>.json (lowered names and the cubin's sha256) written last; a file lock guards each key and the cache
is re-checked after taking it. A cubin whose hash does not match its metadata is rebuilt.
DDTREE_KERNEL_CACHE_REQUIRE=1 makes a miss fatal (CI after a warm step, the decode loop).
We always ship CUBIN: the driver may be older than NVRTC, so PTX JIT is never relied on.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .errors import CompileError, CudaError, check

ARCHS = ("90a", "100a", "103a", "120a")
CACHE_FORMAT = "2"  # bump when the cache layout or key recipe changes (2: relocatable paths)
_BASE_OPTIONS = ("-default-device", "-DNDEBUG", "-std=c++17")  # both first two are required by CuTe
# DDTREE_TRACE=1: every family built with the per-warp timeline stamps (runtime/cuda/trace.py; own cache entries)
TRACE_BUILD = os.environ.get("DDTREE_TRACE") == "1"


def _env_mask(name: str, what: str) -> str:
    """A diagnostic build option from the environment: '' (unset) or a decimal mask."""
    value = os.environ.get(name, "")
    if value and not value.isdigit():
        raise ValueError(f"{name}={value!r}: want a mask of {what}, a decimal number")
    return value


# with it, DDTREE_TRACE_STALLS=mask: the spans counted in each warp's stall word (device_common.cuh TraceStallSite)
TRACE_STALLS = _env_mask("DDTREE_TRACE_STALLS", "device_common.cuh's TraceStallSite values")
# DDTREE_WS_PROBE=mask: timing probes of moe_gmma_ws_kernel (1 / 2 / 4) and of moe_gmma_kernel's register-A
# pipelines (8 / 16 / 32 / 64 / 128 / 256 / 512 / 1024) that leave out parts of their stage (moe_int4_sm90.cu
# WsProbe); their outputs are then wrong. Diagnostics only (tools/bench_moe.py's stage times); that family's own
# cache entries, the others unchanged.
WS_PROBE = int(_env_mask("DDTREE_WS_PROBE", "moe_int4_sm90.cu's WsProbe values") or 0)   # 0: the real kernel
if WS_PROBE:
    print(f"[ddtree] DDTREE_WS_PROBE={WS_PROBE}: the wgmma MoE kernels built as timing probes, their outputs are wrong",
          file=sys.stderr, flush=True)


def _nvrtc():
    from cuda.bindings import nvrtc
    return nvrtc


@lru_cache(maxsize=None)
def nvrtc_version() -> str:
    major, minor = check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


@lru_cache(maxsize=None)
def nvrtc_build_id() -> str:
    """NVRTC major.minor plus the wheel's full version when known (nvrtcVersion has no patch level)."""
    try:
        from importlib.metadata import version
        return f"{nvrtc_version()}/{version('nvidia-cuda-nvrtc')}"
    except Exception:  # NVRTC from a system toolkit: major.minor is all we can know
        return nvrtc_version()


# ---------------------------------------------------------------- headers
def _site_dirs():
    return [Path(p) for p in sys.path if p and Path(p).is_dir()]


def _find_wheel_header_dir(pathfinder_name: str, relative: list[str], marker: str) -> Path:
    """A header directory shipped in an NVIDIA wheel: the first sys.path entry that has it (so the wheels
    of the running environment win over a system CUDA), then cuda.pathfinder."""
    for site in _site_dirs():
        for rel in relative:
            if (site / rel / marker).exists():
                return site / rel
    try:
        from cuda.pathfinder import locate_nvidia_header_directory
        found = locate_nvidia_header_directory(pathfinder_name)
        if found is not None:
            path = Path(getattr(found, "abs_path", found))
            if (path / marker).exists():
                return path
    except Exception:  # older pathfinder without this function, or not installed
        pass
    raise FileNotFoundError(f"cannot find the {pathfinder_name} headers ({marker}); "
                            f"install the nvidia wheels listed in pyproject.toml")


@lru_cache(maxsize=None)
def include_dirs() -> tuple[str, ...]:
    """-I directories: CUDA runtime headers, CCCL, CUTLASS/CuTe, and cutlass_kernels/ itself."""
    cudart = _find_wheel_header_dir("cudart", ["nvidia/cu13/include", "nvidia/cuda_runtime/include"],
                                    "cuda_bf16.h")
    cccl = _find_wheel_header_dir("cccl", ["nvidia/cu13/include/cccl", "nvidia/cuda_cccl/include"],
                                  "cuda/std/type_traits")
    _check_cccl_version(cccl)
    cutlass = os.environ.get("DDTREE_CUTLASS_INCLUDE")
    if not cutlass:
        # the nvidia-cutlass package's folder, or (a standalone build: tools/build_binary.py) its headers alone
        spec = importlib.util.find_spec("cutlass_library")
        if spec is not None and spec.submodule_search_locations:
            cutlass = str(Path(list(spec.submodule_search_locations)[0]) / "source" / "include")
        else:
            cutlass = str(_find_wheel_header_dir("cutlass", ["cutlass_library/source/include"], "cute/tensor.hpp"))
    if not (Path(cutlass) / "cute" / "tensor.hpp").exists():
        raise FileNotFoundError(f"CUTLASS include dir {cutlass} has no cute/tensor.hpp")
    dirs = [kernel_source_dir(), cudart, cccl]
    # CUTLASS built by a CUDA >= 13 compiler includes <cccl/cuda/std/...>: the directory that holds cccl/
    # must be on the path too. It is cudart's where both come from one environment; not where the CCCL
    # wheel lies elsewhere (carried wheels on the device machine).
    if cccl.name == "cccl" and not (cudart / "cccl" / "cuda" / "std").is_dir():
        dirs.append(cccl.parent)
    return (*map(str, dirs), str(cutlass))


def _check_cccl_version(cccl: Path):
    """CCCL 3.2+ breaks CUTLASS 4.2 under NVRTC (tuple_size clash in cute/container/array.hpp): say so
    up front instead of letting the first CuTe build fail with a template error."""
    m = re.search(r"#define CCCL_VERSION (\d+)", (cccl / "cuda/std/__cccl/version.h").read_text(errors="replace"))
    if m and int(m.group(1)) >= 3002000:
        import warnings
        warnings.warn(f"CCCL {int(m.group(1)) // 1000000}.{int(m.group(1)) // 1000 % 1000} at {cccl} is too new "
                      "for CUTLASS 4.2 under NVRTC; install nvidia-cuda-cccl<13.2", stacklevel=3)


def kernel_source_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "cutlass_kernels"


_INCLUDE_RE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]+)[>"]', re.M)
_header_memo: dict[str, tuple[tuple[int, int], bytes, tuple[tuple[bool, str], ...]]] = {}


def _scan(path: str):
    """(content hash, [(quoted?, include name)]) of one file, memoised on (mtime, size)."""
    st = os.stat(path)
    stamp = (st.st_mtime_ns, st.st_size)
    hit = _header_memo.get(path)
    if hit is not None and hit[0] == stamp:
        return hit[1], hit[2]
    data = Path(path).read_bytes()
    incs = tuple((q == b'"', n.decode()) for q, n in _INCLUDE_RE.findall(data))
    digest = hashlib.sha256(data).digest()
    _header_memo[path] = (stamp, digest, incs)
    return digest, incs


def _relocatable(path: str, roots: tuple[str, ...]) -> str:
    """path as "<i>/relative" under the first of roots that holds it (else as it is): the key then names where a
    file sits among the roots, not on this disk, so the same files in another venv or a moved install keep it."""
    for i, root in enumerate(roots):
        rel = os.path.relpath(path, root)
        if rel != ".." and not rel.startswith(".." + os.sep):
            return f"<{i}>/{rel}"
    return path


def dependency_digest(source: Path, dirs: tuple[str, ...]) -> tuple[str, int]:
    """sha256 over the source and every header reachable from it, each named relative to the source's directory
    or the include directory that holds it (not by its absolute path); returns (hex, number of files)."""
    seen: dict[str, bytes] = {}
    missing: set[str] = set()
    stack = [str(source)]
    while stack:
        path = stack.pop()
        if path in seen:
            continue
        digest, incs = _scan(path)
        seen[path] = digest
        here = os.path.dirname(path)
        for quoted, name in incs:
            cands = ([os.path.join(here, name)] if quoted else []) + [os.path.join(d, name) for d in dirs]
            for cand in cands:
                if os.path.isfile(cand):
                    stack.append(os.path.normpath(cand))
                    break
            else:
                missing.add(name)  # NVRTC builtins (<cstdint> ...): the NVRTC version covers them
    roots = tuple(os.path.normpath(r) for r in (os.path.dirname(str(source)), *dirs))
    h = hashlib.sha256()
    for name, digest in sorted((_relocatable(path, roots), d) for path, d in seen.items()):
        h.update(name.encode() + b"\0" + digest)
    for name in sorted(missing):
        h.update(b"missing\0" + name.encode())
    return h.hexdigest(), len(seen)


# ---------------------------------------------------------------- build
@dataclass
class CompiledModule:
    family: str
    arch: str
    cubin: bytes
    lowered: dict[str, str]  # entry name expression -> mangled symbol
    key: str
    ptx_path: str
    from_cache: bool
    build_s: float = 0.0
    log: str = ""
    path: str = ""

    @property
    def ptx(self) -> str:
        """The PTX NVRTC produced alongside the CUBIN (for instruction checks; never loaded)."""
        return Path(self.ptx_path).read_text()

    def sass(self) -> str:
        return disassemble(self.cubin)

    @functools.cached_property
    def param_sizes(self) -> dict[str, tuple[int, ...]]:
        """Mangled entry symbol -> its parameters' sizes in bytes, in order (from the PTX signatures)."""
        return ptx_entry_params(self.ptx)

    def entry_param_sizes(self, entry: str) -> tuple[int, ...] | None:
        """The parameter sizes of a registered entry ("moe_gmma_kernel<0, 64, 3>"), None if the PTX lacks it."""
        return self.param_sizes.get(self.lowered[entry])

    @functools.cached_property
    def registers(self) -> dict[str, int]:
        """Registered entry -> registers per thread, read from the CUBIN (no GPU needed)."""
        by_symbol = cubin_register_counts(self.cubin)
        return {entry: by_symbol[sym] for entry, sym in self.lowered.items() if sym in by_symbol}


def cubin_register_counts(cubin: bytes) -> dict[str, int]:
    """Symbol -> registers per thread of every kernel in a CUBIN: the EIATTR_REGCOUNT records of its .nv.info
    section (each record: format byte, attribute byte, u16 size, then for this attribute the u32 symbol index
    and the u32 count), symbols resolved through .symtab / .strtab. (What cuobjdump -res-usage prints.)"""
    import struct
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]

    def cstr(offset: int) -> str:
        return cubin[offset:cubin.index(b"\0", offset)].decode()

    names = [cstr(sections[shstrndx][4] + sec[0]) for sec in sections]
    symtab, strtab = sections[names.index(".symtab")], sections[names.index(".strtab")]
    symbols = [cstr(strtab[4] + struct.unpack_from("<I", cubin, off)[0])
               for off in range(symtab[4], symtab[4] + symtab[5], 24)]
    counts = {}
    for sec, name in zip(sections, names):
        if name != ".nv.info":
            continue
        at, end = sec[4], sec[4] + sec[5]
        while at < end:
            fmt, attr, size = struct.unpack_from("<BBH", cubin, at)
            if fmt == 0x04:                  # EIFMT_SVAL: `size` bytes of value follow
                if attr == 0x2F:             # EIATTR_REGCOUNT
                    sym, regs = struct.unpack_from("<II", cubin, at + 4)
                    counts[symbols[sym]] = regs
                at += 4 + size
            else:                            # EIFMT_NVAL / BVAL / HVAL: the 4-byte header only
                at += 4
    return counts


_PTX_PARAM_TYPE = re.compile(r"\.[bsuf](8|16|32|64)\b")


def ptx_entry_params(ptx: str) -> dict[str, tuple[int, ...]]:
    """Each `.entry`'s parameter sizes in bytes, in order: `.param .u64 .ptr .align 1 name` is 8, `.param .u32
    name` 4, `.param .align 8 .b8 name[16]` (a struct by value) 16."""
    out = {}
    for m in re.finditer(r"\.entry\s+([\w$.]+)\s*\(([^)]*)\)", ptx):
        sizes = []
        for decl in m.group(2).split(","):
            if ".param" not in decl:
                continue
            t = _PTX_PARAM_TYPE.search(decl)
            if t is None:
                raise ValueError(f"PTX entry {m.group(1)}: cannot read the parameter type of {decl.strip()!r}")
            count = re.search(r"\[(\d+)\]\s*$", decl.strip())
            sizes.append(int(t.group(1)) // 8 * (int(count.group(1)) if count else 1))
        out[m.group(1)] = tuple(sizes)
    return out


def resolve_arch(arch: str | None) -> str:
    """Explicit arch, else DDTREE_CUDA_ARCH, else the current device's."""
    arch = arch or os.environ.get("DDTREE_CUDA_ARCH")
    if not arch:
        from .device import get_device
        dev = get_device()
        if dev.arch is None:
            raise ValueError(f"{dev.name} has compute capability {dev.cc[0]}.{dev.cc[1]}, which has no build "
                             f"target; set DDTREE_CUDA_ARCH to one of {', '.join(ARCHS)}")
        arch = dev.arch
    arch = arch.removeprefix("sm_")
    if arch not in ARCHS:
        raise ValueError(f"unsupported CUDA arch {arch!r}; expected one of {', '.join(ARCHS)}")
    return arch


def cache_dir() -> Path:
    root = os.environ.get("DDTREE_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ddtree", "kernels")
    return Path(root)


def _family(family):
    if isinstance(family, str):
        from cutlass_kernels.registry import FAMILIES
        if family not in FAMILIES:
            raise KeyError(f"unknown kernel family {family!r}; registered: {', '.join(sorted(FAMILIES))}")
        return FAMILIES[family]
    return family


def build_options(family, arch: str) -> list[str]:
    return [*_BASE_OPTIONS, f"--gpu-architecture=sm_{arch}", *(f"-I{d}" for d in include_dirs()),
            *family.options, *(("-DDDTREE_TRACE=1",) if TRACE_BUILD else ()),
            *((f"-DDDTREE_TRACE_STALLS={int(TRACE_STALLS)}",) if TRACE_BUILD and TRACE_STALLS else ()),
            *((f"-DDDTREE_WS_PROBE={WS_PROBE}",) if WS_PROBE and family.name == "moe_int4_sm90" else ())]


def cache_key(family, arch: str) -> str:
    """The family's cache entry name: NVRTC's build, the arch, the sources' contents, the entries and the options,
    with each include directory by its place in the search order (its files' contents are in the digest), so a
    cache stays valid for the same files elsewhere (another venv, a moved ddtree-run folder)."""
    family = _family(family)
    dirs = include_dirs()
    deps, _ = dependency_digest(family.source_path, dirs)
    where = {f"-I{d}": f"-I<{i + 1}>" for i, d in enumerate(dirs)}   # <0> is the source's own directory
    h = hashlib.sha256()
    for part in (CACHE_FORMAT, nvrtc_build_id(), arch, deps, *family.entries, "\0",
                 *(where.get(o, o) for o in build_options(family, arch))):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def nvrtc_compile(source: str, name: str, entries, options, family: str = "?", arch: str = "?"):
    """One NVRTC run -> (cubin bytes, ptx text, {entry: lowered name}, log). Raises CompileError."""
    nv = _nvrtc()
    prog = check(nv.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        for e in entries:
            check(nv.nvrtcAddNameExpression(prog, e.encode()), "nvrtcAddNameExpression")
        opts = [o.encode() for o in options]
        result = nv.nvrtcCompileProgram(prog, len(opts), opts)
        size = check(nv.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        # Fresh mutable buffers: NVRTC writes into them. (b" " * 1 is CPython's cached one-byte object, and
        # writing a NUL into it once turned every b" " in the process into b"\0".)
        buf = bytearray(size)
        check(nv.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = bytes(buf).rstrip(b"\0 ").decode(errors="replace")
        if int(result[0]) != 0:
            raise CompileError(family, arch, log or str(result[0]))
        size = check(nv.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        if size == 0:
            raise CompileError(family, arch, "NVRTC produced no CUBIN (is the arch an sm_ target?)")
        cubin = bytearray(size)
        check(nv.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        cubin = bytes(cubin)
        size = check(nv.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        ptx = bytearray(size)
        check(nv.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        ptx = bytes(ptx)
        lowered = {}
        for e in entries:
            low = check(nv.nvrtcGetLoweredName(prog, e.encode()), "nvrtcGetLoweredName")
            lowered[e] = low.decode() if isinstance(low, bytes) else str(low)
        return cubin, ptx.rstrip(b"\0").decode(), lowered, log
    finally:
        nv.nvrtcDestroyProgram(prog)


def _read_cached(cubin_path: Path, meta_path: Path):
    """A verified cache entry, or None when absent or damaged."""
    try:
        meta = json.loads(meta_path.read_text())
        cubin = cubin_path.read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not isinstance(meta.get("lowered"), dict):  # damaged metadata: rebuild
        return None
    if hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256") or cubin[:4] != b"\x7fELF":
        return None
    if not cubin_path.with_suffix(".ptx").is_file():  # kept for the instruction checks
        return None
    return cubin, meta


def _write_atomic(path: Path, data: bytes):
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def compile_family(family, arch: str | None = None, *, progress: bool = True) -> CompiledModule:
    """CUBIN for one family and arch, from the disk cache or a fresh NVRTC build."""
    family = _family(family)
    arch = resolve_arch(arch)
    key = cache_key(family, arch)
    d = cache_dir() / nvrtc_version() / arch
    cubin_path, meta_path = d / f"{key}.cubin", d / f"{key}.json"
    hit = _read_cached(cubin_path, meta_path)
    if hit is None:
        if os.environ.get("DDTREE_KERNEL_CACHE_REQUIRE") == "1":
            raise CudaError("kernel cache", detail=f"miss for {family.name} sm_{arch} ({cubin_path}) "
                            "with DDTREE_KERNEL_CACHE_REQUIRE=1")
        d.mkdir(parents=True, exist_ok=True)
        with open(d / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            hit = _read_cached(cubin_path, meta_path)  # another process may have built it meanwhile
            if hit is None:
                if progress:
                    print(f"[ddtree] compiling {family.name} for sm_{arch} ...", file=sys.stderr, flush=True)
                t0 = time.perf_counter()
                cubin, ptx, lowered, log = nvrtc_compile(family.source_path.read_text(), family.source,
                                                    family.entries, build_options(family, arch),
                                                    family.name, arch)
                dt = time.perf_counter() - t0
                if progress:
                    print(f"[ddtree] compiled {family.name} for sm_{arch} in {dt:.1f} s", file=sys.stderr,
                          flush=True)
                meta = {"family": family.name, "arch": arch, "lowered": lowered, "nvrtc": nvrtc_version(),
                        "cubin_sha256": hashlib.sha256(cubin).hexdigest(), "build_s": round(dt, 3),
                        "log": log}
                _write_atomic(cubin_path.with_suffix(".ptx"), ptx.encode())
                _write_atomic(cubin_path, cubin)
                _write_atomic(meta_path, json.dumps(meta, indent=1).encode())  # metadata last
                return CompiledModule(family.name, arch, cubin, lowered, key, str(cubin_path.with_suffix(".ptx")),
                                      False, dt, log, str(cubin_path))
    cubin, meta = hit
    return CompiledModule(family.name, arch, cubin, meta["lowered"], key, str(cubin_path.with_suffix(".ptx")),
                          True, meta.get("build_s", 0.0), meta.get("log", ""), str(cubin_path))


def _build_one(name: str, arch: str):
    """Worker body for compile_all (runs in a spawned process)."""
    t0 = time.perf_counter()
    mod = compile_family(name, arch, progress=False)
    return name, arch, mod.from_cache, time.perf_counter() - t0


def compile_all(names=None, archs=None, jobs: int | None = None, progress: bool = True,
                errors: str = "raise") -> dict:
    """Warm the cache for many (family, arch) pairs, misses built in parallel processes.
    Returns {(name, arch): CompiledModule}. Prints a stderr line per kernel built on a cold cache.
    Every pair is attempted; failures are then raised together (errors="raise") or left out of the
    result and listed in the returned dict's `failed` attribute (errors="skip")."""
    from cutlass_kernels.registry import FAMILIES
    names = list(names or FAMILIES)
    archs = [resolve_arch(a) for a in (archs or [None])]
    pairs = [(n, a) for n in names for a in archs if _family(n).targets(a)]
    missing = []
    for n, a in pairs:
        key = cache_key(n, a)
        d = cache_dir() / nvrtc_version() / a
        if _read_cached(d / f"{key}.cubin", d / f"{key}.json") is None:
            missing.append((n, a))
    failed: dict[tuple[str, str], Exception] = {}
    if missing:
        jobs = max(1, min(jobs or os.cpu_count() or 1, len(missing)))
        if progress:
            print(f"[ddtree] kernel cache cold for {len(missing)} of {len(pairs)} kernels; "
                  f"compiling with {jobs} processes (NVRTC {nvrtc_version()})", file=sys.stderr, flush=True)

        def report(i, n, a, fut_or_exc):
            try:
                dt = fut_or_exc() if callable(fut_or_exc) else fut_or_exc
                msg = f"{dt:.1f} s"
            except Exception as e:  # keep going: every kernel gets its try, failures are reported at the end
                failed[(n, a)] = e
                msg = f"FAILED ({type(e).__name__})"
            if progress:
                print(f"[ddtree] [{i}/{len(missing)}] {n} sm_{a}: {msg}", file=sys.stderr, flush=True)

        if jobs == 1:
            for i, (n, a) in enumerate(missing, 1):
                report(i, n, a, lambda n=n, a=a: _build_one(n, a)[3])
        else:
            import multiprocessing as mp
            with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
                futs = {pool.submit(_build_one, n, a): (n, a) for n, a in missing}
                for i, fut in enumerate(as_completed(futs), 1):
                    n, a = futs[fut]
                    report(i, n, a, lambda fut=fut: fut.result()[3])
    if failed and errors == "raise":
        (n, a), first = next(iter(failed.items()))
        listing = ", ".join(f"{n} sm_{a}" for n, a in failed)
        if isinstance(first, CompileError):
            raise CompileError(first.family, first.arch, f"{len(failed)} kernel builds failed ({listing}); "
                               f"first log:\n{first.log}") from first
        raise first
    result = _Built({(n, a): compile_family(n, a, progress=False) for n, a in pairs if (n, a) not in failed})
    result.failed = failed
    return result


class _Built(dict):
    """compile_all's result: {(name, arch): CompiledModule}, plus .failed {(name, arch): exception}."""
    failed: dict


# ---------------------------------------------------------------- SASS
def find_disassembler() -> tuple[str, list[str]] | None:
    """(path, args) of nvdisasm or cuobjdump, or None. Looks at $DDTREE_NVDISASM, PATH, /usr/local/cuda,
    then the nvidia-cuda-nvdisasm / -cuobjdump wheels through cuda.pathfinder."""
    import shutil
    candidates = []
    if os.environ.get("DDTREE_NVDISASM"):
        candidates.append(os.environ["DDTREE_NVDISASM"])
    for tool in ("nvdisasm", "cuobjdump"):
        candidates += [shutil.which(tool), f"/usr/local/cuda/bin/{tool}"]
        try:
            from cuda.pathfinder import find_nvidia_binary_utility
            candidates.append(find_nvidia_binary_utility(tool))
        except Exception:
            pass
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c, (["--dump-sass"] if os.path.basename(c).startswith("cuobjdump") else [])
    return None


def disassemble(cubin: bytes) -> str:
    """SASS text of a CUBIN; FileNotFoundError when no disassembler is installed."""
    import subprocess
    import tempfile
    tool = find_disassembler()
    if tool is None:
        raise FileNotFoundError("no nvdisasm or cuobjdump found (PATH, /usr/local/cuda/bin, nvidia wheels)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool[0], *tool[1], f.name], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{tool[0]} failed on a cubin: {out.stderr.strip()}")
    return out.stdout
