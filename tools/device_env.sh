# Source on the device machine from the repo root (carry .whl): installs the carried wheels the image lacks
# (nvidia-cutlass headers, CCCL < 13.2, gguf, ...) into /tmp/site and builds the Cython extensions in place.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
# .whl/headers/*.whl (optional): only their include/ trees into /tmp/site (e.g. nvidia-cuda-runtime's cuda_bf16.h beside
# the carried CCCL), so NVRTC sees the same headers and include paths as the machine that prebuilt a carried kernel
# cache: the cache keys then match (runtime/cuda/nvrtc.py cache_key) and nothing is compiled again.
for w in .whl/headers/*.whl; do
  [ -f "$w" ] || continue
  python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, '/tmp/site') for n in z.namelist() if '/include/' in n]" "$w" || return 1
done
# .carry/kc.tar.xz (optional): a kernel cache prebuilt elsewhere (kc/<nvrtc>/<arch>/..., tools/prebuild_cache.sh),
# unpacked into /tmp/kc, which becomes the cache
if [ -f .carry/kc.tar.xz ]; then
  tar -C /tmp -xJf .carry/kc.tar.xz && export DDTREE_KERNEL_CACHE=/tmp/kc || return 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/tmp/build_ext.log 2>&1 || { cat /tmp/build_ext.log; return 1; }
