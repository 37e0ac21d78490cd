# Source on the device machine from the repo root (carry .whl): installs the carried wheels the image lacks
# (nvidia-cutlass headers, CCCL < 13.2, gguf, ...) into /tmp/site and builds the Cython extensions in place.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/tmp/build_ext.log 2>&1 || { cat /tmp/build_ext.log; return 1; }
