# Prebuild the kernel cache for the device machine here (NVRTC needs no GPU) into .carry/kc.tar.xz, which
# tools/device_env.sh unpacks there. The keys match only where NVRTC sees the same headers: the same wheels in
# .whl/ (and nvidia-cuda-runtime's headers in .whl/headers/) as this machine's environment (README.md, Test); a
# mismatch costs nothing but the compiles it would have saved. Rebuild after any kernel source change.
#   bash tools/prebuild_cache.sh [--fresh] [ARCHS]     (default 90a; as ddtree-run --build-kernels takes them)
# Each run adds to the existing archive (--fresh: starts empty), so builds of other options go in one archive:
#   DDTREE_TRACE=1 bash tools/prebuild_cache.sh; DDTREE_TRACE=1 DDTREE_TRACE_STALLS=18 bash tools/prebuild_cache.sh
set -e
fresh=0
if [ "${1:-}" = --fresh ]; then fresh=1; shift; fi
out=$(mktemp -d)
if [ $fresh = 0 ] && [ -f .carry/kc.tar.xz ]; then tar -C "$out" -xJf .carry/kc.tar.xz; fi
DDTREE_KERNEL_CACHE=$out/kc python3 -m tools.ddtree_run --build-kernels "${1:-90a}"
mkdir -p .carry
tar -C "$out" -cJf .carry/kc.tar.xz kc
rm -rf "$out"
ls -la .carry/kc.tar.xz
