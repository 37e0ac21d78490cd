"""NVRTC builds (no GPU needed): every registered family compiles for every arch with the instruction it
needs, and the on-disk kernel cache hits, invalidates and repairs itself as it should."""
import hashlib
import json
import os
import shutil
import re
import textwrap

import pytest

from cutlass_kernels.registry import FAMILIES, KernelFamily
from runtime.cuda import CompileError, CudaError, compile_all, compile_family, nvrtc


@pytest.fixture(scope="module")
def built():
    """Every (family, arch) pair, from the shared cache (cold in CI: built in parallel with progress)."""
    return compile_all(archs=nvrtc.ARCHS)


def test_every_family_compiles_for_every_arch(built):
    for name, fam in FAMILIES.items():
        for arch in fam.archs:
            mod = built[(name, arch)]
            assert mod.cubin[:4] == b"\x7fELF", f"{name} sm_{arch}: not a CUBIN"
            assert set(mod.lowered) == set(fam.entries), f"{name} sm_{arch}: entries {mod.lowered}"
            assert all(mod.lowered.values()), f"{name} sm_{arch}: empty lowered name"
            # the PTX target line proves NVRTC built for the arch we asked (sm_90a, not sm_90)
            assert re.search(rf"^\.target sm_{arch}\b", mod.ptx, re.M), f"{name}: wrong .target"


def test_required_instructions_in_ptx(built):
    checked = 0
    for name, fam in FAMILIES.items():
        for arch, pattern in (fam.required_ptx or {}).items():
            assert re.search(pattern, built[(name, arch)].ptx), \
                f"{name} sm_{arch}: PTX lacks /{pattern}/ (a wrong-arch atom compiles to a trap)"
            checked += 1
    assert checked >= 4  # at least the mma_smoke family on all four archs


def test_ptx_check_tells_archs_apart(built):
    """The check can fail: each arch's MMA instruction is absent from the other archs' smoke kernel."""
    smoke = FAMILIES["mma_smoke"].required_ptx
    for arch in ("90a", "100a", "120a"):
        for other in ("90a", "100a", "120a"):
            found = re.search(smoke[other], built[("mma_smoke", arch)].ptx) is not None
            assert found == (arch == other), (arch, other)


def test_required_instructions_in_sass(built):
    if nvrtc.find_disassembler() is None:
        pytest.skip("no nvdisasm/cuobjdump (PATH, /usr/local/cuda/bin, nvidia wheels); the PTX check ran instead")
    checked = 0
    for name, fam in FAMILIES.items():
        for arch, pattern in (fam.required_sass or {}).items():
            sass = built[(name, arch)].sass()
            assert re.search(pattern, sass), f"{name} sm_{arch}: SASS lacks /{pattern}/"
            checked += 1
    assert checked >= 4
    assert not re.search(FAMILIES["mma_smoke"].required_sass["90a"], built[("mma_smoke", "120a")].sass())


# ---------------------------------------------------------------- cache behaviour, on a tiny family
SOURCE = textwrap.dedent("""\
    #include "probe_header.cuh"
    extern "C" __global__ void scale_kernel(float* x, int n) {
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) x[i] *= PROBE_FACTOR;
    }
    template <int N> __global__ void fill_kernel(int* x) { x[threadIdx.x] = N; }
    """)


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DDTREE_KERNEL_CACHE_REQUIRE", raising=False)
    src = tmp_path / "src"
    src.mkdir()
    (src / "probe.cu").write_text(SOURCE)
    (src / "probe_header.cuh").write_text("#define PROBE_FACTOR 2.0f\n")
    fam = KernelFamily("probe", str(src / "probe.cu"), ("scale_kernel", "fill_kernel<7>"))
    return fam, src


def test_second_build_is_a_cache_hit(tiny, capsys):
    fam, _ = tiny
    first = compile_family(fam, "90a")
    assert not first.from_cache
    assert "compiling probe for sm_90a" in capsys.readouterr().err  # progress on a cold cache
    second = compile_family(fam, "90a")
    assert second.from_cache and second.cubin == first.cubin and second.key == first.key
    assert second.lowered["scale_kernel"] == "scale_kernel"
    assert second.lowered["fill_kernel<7>"].startswith("_Z")  # a mangled template instance
    assert compile_family(fam, "100a").key != first.key  # arch is in the key


def test_header_change_invalidates(tiny):
    fam, src = tiny
    first = compile_family(fam, "90a")
    (src / "probe_header.cuh").write_text("#define PROBE_FACTOR 3.0f\n")
    os.utime(src / "probe_header.cuh", ns=(1, 1))  # a new mtime even on coarse clocks: the memo re-reads
    second = compile_family(fam, "90a")
    assert not second.from_cache and second.key != first.key
    assert "0f40400000" in second.ptx.lower() or "3.0" in second.ptx  # the new constant is in the code


def test_cache_key_is_relocatable(tiny, tmp_path, monkeypatch):
    """The same sources and headers at other paths (another venv, a moved ddtree-run folder) give the same key, so
    a cache built in one place hits in the other; a changed header still changes it."""
    fam, src = tiny
    first = compile_family(fam, "90a")
    moved = tmp_path / "elsewhere" / "src"
    shutil.copytree(src, moved)
    linked = []   # the include directories through links: the same files under other paths
    for i, d in enumerate(nvrtc.include_dirs()):
        (tmp_path / f"site{i}").symlink_to(d)
        linked.append(str(tmp_path / f"site{i}"))
    monkeypatch.setattr(nvrtc, "include_dirs", lambda: tuple(linked))
    fam_moved = KernelFamily("probe", str(moved / "probe.cu"), fam.entries)
    again = compile_family(fam_moved, "90a")
    assert again.key == first.key and again.from_cache and again.cubin == first.cubin
    (moved / "probe_header.cuh").write_text("#define PROBE_FACTOR 4.0f\n")
    os.utime(moved / "probe_header.cuh", ns=(1, 1))  # a new mtime even on coarse clocks: the memo re-reads
    assert nvrtc.cache_key(fam_moved, "90a") != first.key


def test_option_change_invalidates(tiny):
    fam, _ = tiny
    first = compile_family(fam, "90a")
    other = KernelFamily(fam.name, fam.source, fam.entries, options=("-DUNUSED_FLAG=1",))
    assert compile_family(other, "90a").key != first.key


def test_corrupted_cache_file_is_rebuilt(tiny):
    fam, _ = tiny
    first = compile_family(fam, "90a")
    path = first.path
    with open(path, "r+b") as f:  # flip bytes in the middle of the cubin
        f.seek(len(first.cubin) // 2)
        f.write(b"\x00garbage\x00")
    again = compile_family(fam, "90a")
    assert not again.from_cache and again.cubin == first.cubin
    with open(path, "wb"):  # truncated to nothing
        pass
    assert compile_family(fam, "90a").cubin == first.cubin
    assert compile_family(fam, "90a").from_cache
    os.remove(first.ptx_path)  # the PTX beside it is part of the entry
    again = compile_family(fam, "90a")
    assert not again.from_cache and "scale_kernel" in again.ptx


def test_damaged_metadata_is_rebuilt(tiny):
    fam, _ = tiny
    first = compile_family(fam, "90a")
    meta = first.path[: -len(".cubin")] + ".json"
    with open(meta, "w") as f:  # valid JSON and a matching cubin hash, but no lowered names
        f.write(json.dumps({"cubin_sha256": hashlib.sha256(first.cubin).hexdigest()}))
    again = compile_family(fam, "90a")
    assert not again.from_cache and again.lowered == first.lowered


def test_require_switch_makes_a_miss_fatal(tiny, monkeypatch):
    fam, _ = tiny
    monkeypatch.setenv("DDTREE_KERNEL_CACHE_REQUIRE", "1")
    with pytest.raises(CudaError, match="DDTREE_KERNEL_CACHE_REQUIRE"):
        compile_family(fam, "90a")


def test_compile_error_carries_the_log(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_KERNEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "bad.cu").write_text('extern "C" __global__ void bad_kernel(int* x) { x[0] = undeclared; }\n')
    with pytest.raises(CompileError) as e:
        compile_family(KernelFamily("bad", str(tmp_path / "bad.cu"), ("bad_kernel",)), "90a")
    assert "undeclared" in e.value.log and e.value.arch == "90a" and e.value.family == "bad"


def test_arch_resolution(monkeypatch):
    monkeypatch.setenv("DDTREE_CUDA_ARCH", "sm_100a")
    assert nvrtc.resolve_arch(None) == "100a"
    assert nvrtc.resolve_arch("120a") == "120a"
    with pytest.raises(ValueError, match="unsupported CUDA arch"):
        nvrtc.resolve_arch("80")


def test_compile_all_tries_every_kernel_then_reports_failures(tmp_path, monkeypatch):
    from cutlass_kernels import registry
    monkeypatch.setenv("DDTREE_KERNEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "bad.cu").write_text('extern "C" __global__ void bad_kernel() { nope(); }\n')
    monkeypatch.setitem(registry.FAMILIES, "bad", KernelFamily("bad", str(tmp_path / "bad.cu"), ("bad_kernel",)))
    built = compile_all(["bad", "runtime_probe"], ["90a"], jobs=1, errors="skip", progress=False)
    assert list(built) == [("runtime_probe", "90a")] and list(built.failed) == [("bad", "90a")]
    with pytest.raises(CompileError, match="1 kernel builds failed"):
        compile_all(["bad", "runtime_probe"], ["90a"], jobs=1, progress=False)


def test_compile_error_crosses_worker_processes():
    """compile_all with jobs > 1 gets a worker's CompileError pickled: it must arrive with its log (it once
    failed to unpickle, and every build of the pool reported BrokenProcessPool instead of the NVRTC log)."""
    import pickle
    err = pickle.loads(pickle.dumps(CompileError("fam", "90a", "the log", kernel="k")))
    assert (err.family, err.arch, err.log, err.kernel) == ("fam", "90a", "the log", "k")
    assert str(err) == str(CompileError("fam", "90a", "the log", kernel="k"))


def test_include_dirs_reach_cccl_from_another_site(tmp_path, monkeypatch):
    """CUTLASS under CUDA 13 includes <cccl/cuda/std/...>: when the CCCL wheel lies in another site than the
    CUDA runtime headers (carried wheels on the device image), the folder holding cccl/ joins the path."""
    cudart = tmp_path / "image" / "nvidia" / "cu13" / "include"
    cccl = tmp_path / "carried" / "nvidia" / "cu13" / "include" / "cccl"
    (cudart).mkdir(parents=True)
    (cudart / "cuda_bf16.h").write_text("")
    (cccl / "cuda" / "std" / "__cccl").mkdir(parents=True)
    (cccl / "cuda" / "std" / "type_traits").write_text("")
    (cccl / "cuda" / "std" / "__cccl" / "version.h").write_text("#define CCCL_VERSION 3001000\n")
    found = {"cudart": cudart, "cccl": cccl}
    monkeypatch.setattr(nvrtc, "_find_wheel_header_dir", lambda name, rel, marker: found[name])
    nvrtc.include_dirs.cache_clear()
    try:
        dirs = nvrtc.include_dirs()
        assert str(cccl.parent) in dirs and dirs.index(str(cudart)) < dirs.index(str(cccl.parent))
        (cudart / "cccl" / "cuda" / "std").mkdir(parents=True)  # one environment: cudart's folder has it
        nvrtc.include_dirs.cache_clear()
        assert str(cccl.parent) not in nvrtc.include_dirs()
    finally:
        nvrtc.include_dirs.cache_clear()


def test_compile_leaves_interned_bytes_alone(tmp_path, monkeypatch):
    """NVRTC writes its log/CUBIN/PTX into the buffers we hand it: they must be fresh mutable buffers. Writing
    into b" " * 1 (CPython's cached one-byte object) once turned every b" " of the process into b"\\0"."""
    monkeypatch.setenv("DDTREE_KERNEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "ok.cu").write_text('extern "C" __global__ void ok_kernel(int* x) { x[0] = 1; }\n')
    compile_family(KernelFamily("ok", str(tmp_path / "ok.cu"), ("ok_kernel",)), "90a")
    space = bytes([32])
    assert b" " == space and b" " * 3 == space * 3


# Register counts that measured speed depends on, checked on the CPU. ptxas re-allocates a kernel when code it
# inlines changes, and for some kernels the allocation is the speed.
# (family, arch, entry) -> (fewest registers, what was measured)
REGISTER_FLOORS = {
    ("moe_int4", "90a", "moe_w4a16_kernel<0, 2, 2, 1, 1, 3>"): (
        110, "the T = 49..128 gate_up default: at 126 registers ptxas issues the activation loads a unit ahead of "
             "their MMAs; builds at 76-96 registers ran the MoE layer 15-20% slower at uniform T = 64..128 "
             "(docs/PERF.md, session of 2026-12-04 (15))"),
}


def test_register_floors(built):
    for (family, arch, entry), (floor, why) in REGISTER_FLOORS.items():
        got = built[(family, arch)].registers[entry]
        assert got >= floor, (
            f"{entry} sm_{arch}: {got} registers, below {floor}: {why}. Time the layer on the GPU before and after "
            f"(tools/bench_moe.py --no-variants --no-plans --tokens 64,96,128 --routing uniform), then update "
            f"REGISTER_FLOORS.")


def test_moe_gate_up_scale_broadcasts_fold_into_operands(built):
    """int4_dequant.cuh's bf16x2_broadcast: ptxas folds the scale words' half broadcasts into the HFMA2 operand
    selectors (.H0_H0 / .H1_H1). Written as __byte_perm they were 4 PRMTs per scale word, 7% of the T = 1 gate_up
    loop (docs/PERF.md, session 32). Checked on every gate_up default, whose kernels have no other PRMT."""
    if nvrtc.find_disassembler() is None:
        pytest.skip("no nvdisasm/cuobjdump: the SASS is not readable here")
    from runtime.kimi_kernels import DEFAULT_VARIANTS, GATE_UP_PIECES
    from tools.sass_loops import function_bodies, opcode
    mod = built[("moe_int4", "90a")]
    bodies = function_bodies(mod.sass())
    entries = {gate_up for gate_up, _ in DEFAULT_VARIANTS.values()} | set(GATE_UP_PIECES.values()) - {None}
    for entry in sorted(entries):
        instructions, _ = bodies[mod.lowered[entry]]
        assert not any(opcode(t) == "PRMT" for t in instructions), entry
        assert any(re.search(r"HFMA2\.BF16_V2 .*\.H[01]_H[01]", t) for t in instructions), entry


def test_cubin_register_counts_match_the_disassembler(built):
    """The CUBIN reader's counts equal the register numbers the kernels' SASS uses (highest R index + 1 is a
    lower bound; the allocation adds the ABI's reserved ones), for a family with several entries."""
    mod = built[("tree_attention", "90a")]
    regs = mod.registers
    assert set(regs) == set(FAMILIES["tree_attention"].entries)
    assert all(24 <= r <= 255 for r in regs.values()), regs
    if nvrtc.find_disassembler() is None:
        pytest.skip("no nvdisasm/cuobjdump: the counts were range-checked only")
    sass = mod.sass()
    for entry, sym in mod.lowered.items():
        body = sass.split(f".text.{sym}:", 1)[1].split(".text.", 1)[0]
        used = max(int(r) for r in re.findall(r"\bR(\d+)\b", body)) + 1
        assert used <= regs[entry] <= used + 8, (entry, used, regs[entry])
