#!/usr/bin/env bash
# compute-sanitizer memcheck + racecheck over one small GPU test per kernel family (the sanitizer slows
# kernels 10-100x, so not the whole suite). Run on the GPU machine from the repo root after
#   . tools/device_env.sh
#   bash tools/gpu_sanitize.sh [TEST NODE IDS...]      (default: the list below)
# Exit status non-zero when a tool reports an error or a test fails under it. SANITIZE_TOOLS="racecheck" runs one
# tool only (racecheck over the whole default list ran past a 260 s step limit in session 22: run it as its own
# device step).
set -uo pipefail
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
  tests=(
    "tests/test_dense_kernels.py::test_sample_philox_bits"            # sample_kernel (Philox)
    "tests/test_dense_kernels.py::test_argmax_and_sample"
    "tests/test_dense_kernels.py::test_argmax_large_vocab[65]"        # argmax_chunk multi-unit chunks
    "tests/test_dense_kernels.py::test_log_softmax_topk"
    "tests/test_dense_kernels.py::test_kv_compact"
    "tests/test_dense_kernels.py::test_attention"
    "tests/test_dense_fusions.py::test_rope_qkv_cache"
    "tests/test_dense_fusions.py::test_linear_gemv"
    "tests/test_dense_fusions.py::test_linear_rmsnorm_prologue[17-960-576-True-None]"   # 32-row tile, chunked norm
    "tests/test_dense_gmma.py::test_linear_gmma_every_instance[<16,2,4,1,3>]"   # pushed partials, CS = 3
    "tests/test_dense_gmma.py::test_linear_gmma_every_instance[<72,2,4,1,3>]"   # DSMEM reduction (no room to push)
    "tests/test_dense_gmma.py::test_linear_gmma_every_instance[<64,2,4,1,4>]"
    "tests/test_dense_gmma.py::test_linear_gmma_graph_replay[push]"   # the push: partials exchanged by st.async
    "tests/test_dense_gmma.py::test_linear_gmma_every_instance[<128,1,6,1,2>]"
    "tests/test_dense_gmma.py::test_linear_gmma_every_instance[<72,2,4,1,2>x1wg]"   # one warpgroup
    "tests/test_dense_gmma.py::test_linear_gmma_every_instance[<136,1,5,1,1>x3wg]"  # three, many tokens
    "tests/test_dense_gmma.py::test_linear_gmma_residual_and_strides"          # workspace split-K too
    "tests/test_dense_gmma.py::test_linear_gmma_narrow_every_instance[<48,16,2,12>]"   # narrow rows, RS wgmma
    "tests/test_dense_gmma.py::test_linear_gmma_narrow_every_instance[<48,80,2,6>]"    # two warpgroups
    "tests/test_dense_gmma.py::test_linear_gmma_narrow_every_instance[<48,16,2,9>rmsnorm]"  # x tile rewritten
    "tests/test_dense_gmma.py::test_linear_gmma_narrow_every_instance[<32,16,4,6>swiglu]"
    # not the cluster kernel (off by default): racecheck reports its ldmatrix reads against one write site, not
    # resolved (docs/PERF.md session 25); its selections: ...every_instance[<48,64,2,6>cs2], [<32,80,1,7>rmsnormcs2],
    # ...narrow_chain_and_graph[cluster]
    "tests/test_dense_gmma.py::test_linear_gmma_narrow_chain_and_graph[one_block]"  # PDL chain of narrow launches
    "tests/test_kimi_kernels.py::test_moe_layer_small"
    "tests/test_kimi_kernels.py::test_routing_same_bits_as_two_kernels[blocks-5-384-8-8-4]"   # ticket, group limit
    "tests/test_kimi_kernels.py::test_routing_same_bits_as_two_kernels[batch-4-384-8-8-4]"    # tokens in one block
    "tests/test_kimi_kernels.py::test_moe_graph_replay_pdl[2-16-True-False-True]"   # hand-offs by counters
    "tests/test_kimi_kernels.py::test_moe_layer_gmma_hot_experts"      # wgmma MoE (sm_90a)
    "tests/test_kimi_kernels.py::test_mla_attention"
  )
fi
export PYTHONUNBUFFERED=1
LOGDIR=${OUT:-/tmp}
rc=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
  echo "=== compute-sanitizer --tool $tool (${#tests[@]} test selections)"
  # --error-exitcode makes a reported hazard fail the run even when the test's own checks pass
  # the whole report goes to $LOGDIR/sanitize_$tool.log; here: each reported hazard's first lines and the summary
  compute-sanitizer --tool "$tool" --error-exitcode 86 --print-limit 20 \
    python3 -m pytest -q -p no:cacheprovider "${tests[@]}" >"$LOGDIR/sanitize_$tool.log" 2>&1
  r=$?
  grep -E -A6 "^========= (Error|Invalid|Race|Warning|Program hit)" "$LOGDIR/sanitize_$tool.log" | head -60
  grep -E "passed|failed|SUMMARY" "$LOGDIR/sanitize_$tool.log" | tail -5
  echo "=== $tool rc=$r (full report: $LOGDIR/sanitize_$tool.log)"
  [ "$r" -eq 0 ] || rc=1
done
exit $rc
