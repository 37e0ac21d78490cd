#!/usr/bin/env bash
# GPU check, run on the GPU machine through the device tool, from the repo root:
#   . tools/device_env.sh && bash tools/gpu_check.sh [TEST PATHS...]   (default: tests/)
# Warms the kernel cache for the device arch (parallel NVRTC), runs every GPU test of the suite, the kernel
# build test (its SASS check uses the image's nvdisasm), then the benchmarks. Everything is appended to
# $OUT/gpu_check.log (the device tool brings back at most 8 files: keep one log, plus one JSON per bench).
# Exit status: non-zero when any step failed; every step runs regardless.
# GPU_CHECK_STEPS="warm_cache pytest_gpu bench_ar" runs only the named steps (a short device call for the checks
# a change needs); the step names are the first word after `step` below.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
export DDTREE_KERNEL_CACHE=${DDTREE_KERNEL_CACHE:-/tmp/ddtree-kernels} PYTHONUNBUFFERED=1
failed=()
known=()
tests=("${@:-tests/}")
STEP_TIMEOUT=${STEP_TIMEOUT:-600}  # seconds per step, so one hung step cannot eat the whole run

step() {  # step NAME COMMAND...: run, tee into the log, remember failures
  local name=$1; shift
  known+=("$name")
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then
    return 0
  fi
  echo "=== [$name] $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$STEP_TIMEOUT" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== [$name] rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

step device nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
step warm_cache python3 -c "import os, runtime.cuda as rc; rc.compile_all(jobs=os.cpu_count())"
step pytest_gpu python3 -m pytest -q -rs -m gpu -p no:cacheprovider "${tests[@]}"
step bench_runtime python3 tools/bench_runtime.py --json "$OUT/bench_runtime.json"
step sanitizer bash tools/gpu_sanitize.sh
step pytest_kernel_build python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernel_build.py
# Other benchmarks: one `step NAME command` line each, below this one.
step bench_tree python3 tools/bench_tree.py
# attention: the decode kernel, the tree-verify kernel and its wgmma twin (sm_90a) at every budget, same run
step bench_dense python3 tools/bench_dense.py --quick --peer --attn-kernels decode tree gmma
# the default plan against: no wgmma hot path, PIPE 7 on the hot experts (the T <= 255 default before PIPE 8),
# the warp-specialized tier alone (the T = 256..767 default before session 40), that tier with PIPE 8 for 17..63
# tokens on 32-token tiles (the T >= 768 default before session 40), and every expert on PIPE 8's 32-token tiles (PERF.md
# session 13), and at T >= 256 the default's tiers with PIPE 5 on the experts of >= 64 tokens (the default before
# session 42) (all plans: `--plans ''`, ~1 hour); --torch: the torch bf16 per-expert loop first, in its own process, for
# the speedup column
step bench_moe python3 tools/bench_moe.py --torch --no-variants --plans 'no-gmma,gmma>=16/ra7,gmma>=64/256/wsn,tiers64wsn/17ra8-32,gmma>=1/32/ra8,ws5'
# small T (PERF.md sessions 26-27; the default is PDL + down's early weight start up to T = 8): plain launches,
# PDL without the early start, down in one wave at T = 1 (three buffers, two row groups), the combine folded into down;
# the routing (session 34's default: "batch" at T = 2..4, else "blocks"): moe_topk + moe_group, the block per token,
# the one-warp one (T = 1); the combine's routing reads after its wait (before it is the default up to T = 4); the
# T = 2 gate_up without its activation tile fitted to T; the block-level hand-offs through counters at T = 1 (signals,
# off by default there) and their absence at T = 2..8 (no-signals), signals with down in fewer waves
step bench_moe_small python3 tools/bench_moe.py --no-variants --tokens 1,2,4,8 --plans 'nopdl,pdl,dn-x3-rg2,flip-comb,route-two,route-blocks,route-warp,comb-late,gu-nofit,signals,no-signals,signals+dn-x3-rg2,signals+dn-xs2-rg2'
# T = 9..31: PDL with down's early start and the block-level hand-offs (the default up to T = 24 since session 36;
# H100: -4..-12 us at T = 12..24, T = 31 skewed +5 us) against plain launches and against PDL + early alone; experts
# of >= 16 tokens on a wgmma tier (the default at T = 25..31 since session 37; at T <= 24 it gives up the hand-offs)
step bench_moe_mid python3 tools/bench_moe.py --no-variants --tokens 12,16,24,31 --plans 'nopdl,no-signals,pdl+early+signals,gmma>=16/32/ra8,gmma>=16/32/ra7'
# large T: PDL (off by default from T = 16), and each hot expert's tile-token chunks on their own blocks
step bench_moe_large python3 tools/bench_moe.py --no-variants --tokens 32,128,256,512,1024 --plans 'pdl,par'
# the layer computing the shared expert's bf16 MLP (88 MB) on its side stream, against one stream and the two alone
step bench_moe_shared python3 tools/bench_moe.py --no-variants --no-plans --shared 1 --tokens 1,2,4,8,16,64,256
# the hot tiers' GEMMs (8 experts x T tokens) against cuBLAS's batched bf16 GEMM of the same shapes (torch child)
step bench_hot_gemm python3 -m tools.bench_hot_gemm
# per-warp timelines (tools/trace_timeline.py: traced kernel builds): the layer + shared MLP at small T, and a 2-layer
# Qwen3-8B-shaped AR / verify step; records into $OUT/trace
step trace_moe python3 tools/trace_timeline.py moe --tokens 1,2,8 --shared 1 --out "$OUT/trace"
# skewed T = 256: the hot tiers (PIPE 20 on >= 64 tokens since session 42) beside the cold chain
step trace_moe_hot python3 tools/trace_timeline.py moe --tokens 256 --routing skewed --out "$OUT/trace"
step trace_step python3 tools/trace_timeline.py step --random qwen3-8b --layers 2 --prefix 1024 --budgets 0,16,64 --out "$OUT/trace"
step bench_stream_rows python3 -m tools.bench_stream_rows
step bench_mla python3 tools/bench_mla.py --kernel mma,gmma,gmma-split
step bench_load python3 tools/bench_load.py --size-gb 4
# the cpu backend's kernels on the device machine's CPU (another ISA than the development VM's)
step bench_cpu python3 -m tools.bench_cpu --m 1,5,17,64
# Engine on CUDA (issue 6): graph-captured AR / DDTree on SmolLM2-135M (the GGUF at DDTREE_SMOLLM2_GGUF),
# host us/round, graph replay times, HF transformers generate as the peer when torch CUDA is there.
# Without the GGUF on the machine: random weights of SmolLM2-135M's shape (same timings, no real text).
e2e_model=(--random smollm2-135m)
[ -n "${DDTREE_SMOLLM2_GGUF:-}" ] && e2e_model=(--model "$DDTREE_SMOLLM2_GGUF")
# AR step and verify b16 / b64 in the graph vs prompt length: the tree-verify attention kernel against the decode
# kernel, the gemv's per-shape plan (KW, persistence) against forcing each, GMMA against mma.sync at verify sizes,
# all in the graph (each was picked from per-op timings)
step bench_ar python3 -m tools.bench_ar --prompts 8,512,1024 --verify-budgets 16,64 --configs tree,decode,decode+kw4,decode+kw8,decode+persist0,decode+persist1,decode+gmma0,decode+fuse32,decode+swiglu32
# bf16 rounding of the AR / verify / prefill paths vs the float32 reference on the real weights: what the lossless
# tests' near-tie tolerance rests on (tests/test_cuda_engine.py NEAR_TIE)
[ -n "${DDTREE_SMOLLM2_GGUF:-}" ] && step logit_error python3 -m tools.logit_error --model "$DDTREE_SMOLLM2_GGUF"
step bench_e2e_cuda python3 -m tools.bench_e2e --backend cuda --budgets 16,64,256 --max-new-tokens 128 --hf "${e2e_model[@]}"
# A trained drafter for the real SmolLM2 (tools/train_dflash.py on the GPU: its answers, then 1500 steps), and DDTree
# with it end to end: real acceptance and speedup over AR (the rows above use a random drafter). Sized to the step
# limit: 384-token answers 16 at a time and 3000 steps took over 600 s on the H200; this ran 242 s (PERF.md (22))
if [ -n "${DDTREE_SMOLLM2_GGUF:-}" ]; then
  step train_drafter python3 -m tools.train_dflash --model "$DDTREE_SMOLLM2_GGUF" --out /tmp/smollm2-dflash \
    --device cuda --layers 3 --new-tokens 192 --gen-batch 64 --steps 1500 --batch 8 --anchors 16
  step bench_e2e_drafter python3 -m tools.bench_e2e --backend cuda --model "$DDTREE_SMOLLM2_GGUF" \
    --draft /tmp/smollm2-dflash --budgets 8,16,32,64 --max-new-tokens 128
fi
# The standalone binary (tools/build_binary.py) on the GPU: built here (carry the PyInstaller wheel), then run on the
# cuda backend from its own folder
if python3 -c "import PyInstaller" 2>/dev/null; then
  step binary_build python3 -m tools.build_binary --out /tmp/ddtree-dist --no-default-model
  [ -n "${DDTREE_SMOLLM2_GGUF:-}" ] && step binary_cuda /tmp/ddtree-dist/ddtree-run/ddtree-run --backend cuda \
    --model "$DDTREE_SMOLLM2_GGUF" --stats --max-new-tokens 64 "Why is the sky blue?"
fi
# Verify step time vs budget (issue 6): a Qwen3-8B-shaped random bf16 model (16 GB, built in memory), prefix
# 1024, graph replay of the one-token step and of verify at budgets 16..256 as ratios to it, weights / time vs
# the read bandwidth, the target line "budget 64 <= 1.25x AR", and the per-op table of AR vs verify b64.
step bench_verify python3 -m tools.bench_verify --per-op 64
# The GMMA linear's plan rules in the verify graph (each picked from per-op timings): a 12-layer Qwen3-8B shape at
# prefix 1024, verify b32..b512, the default plan against two-warpgroup blocks at the token tiles 136 / 192, against
# no one-warpgroup pairs, against their 4-stage rings and with the push epilogue, same weights, one run
step bench_ar_gmma python3 -m tools.bench_ar --random qwen3-8b --layers 12 --prompts 1024 --new-tokens 8 --verify-budgets 32,64,128,256,512 --configs decode,decode+3wg0,decode+1wg0,decode+1wgs4,decode+push0,decode+narrow0,decode+gmmadec0
# The narrow-row GMMA linear (off by default until this runs): per op at the Qwen3-8B shapes against the planned
# kernels, the streaming read by SM count (does an idle SM cost its share?), then in the 12-layer step (AR, b16, b32,
# b64), with rmsnorm / SwiGLU fused into it and as their own launches
step bench_narrow python3 tools/bench_dense.py --linear-only --gmma --read-by-sms --m 1 17 33 64 65 --ops Qwen3-8B:qkv Qwen3-8B:o Qwen3-8B:gate_up Qwen3-8B:down
# Kimi K2's shared-expert linears at the MoE layer's small T (every GMMA / narrow instance; SwiGLU fused into down)
step bench_kimi_shared python3 tools/bench_dense.py --linear-only --gmma --fused --m 1 2 4 8 16 --ops Kimi-K2:shared_gate_up Kimi-K2:shared_down
# The GMMA linear's weight loads alone (cp.async / bulk copies, by grid size; single launches and PDL chains): the
# ceiling its load pattern sets, per op
step bench_w_tiles python3 -m tools.bench_w_tiles --ops qkv o down gate_up --bisect-m 17 33 64 65 --trace-m 33
# rmsnorm (+ residual add) / SwiGLU fused into the narrow kernel against separate launches, per op
step bench_fused python3 tools/bench_dense.py --linear-only --fused --m 1 17 33 65 --ops Qwen3-8B:qkv Qwen3-8B:gate_up Qwen3-8B:down
step bench_ar_narrow python3 -m tools.bench_ar --random qwen3-8b --layers 12 --prompts 1024 --new-tokens 8 --verify-budgets 16,32,64 --configs decode,decode+narrow1+nfuse0+nmc0,decode+narrow1+nfuse0,decode+narrow1

for want in ${GPU_CHECK_STEPS:-}; do   # a misspelt step name must not pass as "all steps passed"
  [[ " ${known[*]} " == *" $want "* ]] || failed+=("unknown-step:$want")
done
if [ ${#failed[@]} -ne 0 ]; then
  echo "gpu_check: FAILED steps: ${failed[*]}" | tee -a "$LOG"
  exit 1
fi
echo "gpu_check: all steps passed" | tee -a "$LOG"
