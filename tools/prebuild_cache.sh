# Prebuild the kernel cache for the device machine here (NVRTC needs no GPU) into .carry/kc.tar.xz, which
# tools/device_env.sh unpacks there. The keys match only where NVRTC sees the same headers: the same wheels in
# .whl/ (and nvidia-cuda-runtime's headers in .whl/headers/) as this machine's environment (README.md, Test); a
# mismatch costs nothing but the compiles it would have saved.
#   bash tools/prebuild_cache.sh [ARCHS]     (default 90a; as ddtree-run --build-kernels takes them)
set -e
out=$(mktemp -d)
DDTREE_KERNEL_CACHE=$out/kc python3 -m tools.ddtree_run --build-kernels "${1:-90a}"
mkdir -p .carry
tar -C "$out" -cJf .carry/kc.tar.xz kc
rm -rf "$out"
ls -la .carry/kc.tar.xz
