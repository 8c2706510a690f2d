#!/usr/bin/env bash
# The one GPU-machine run (device tool, carry [".gpu"]): builds nothing there.
#   1. correctness: our CUDA bf16 forward vs HF transformers Qwen3ForCausalLM on the same random
#      weights (2-layer Qwen3-0.6B shape, safetensors written on the box), mixed extend/decode;
#   2. our decode-step latency (batch 1..32, context 1024) and extend-512 latency for the
#      Qwen3-0.6B and Qwen3-32B shapes (random weights made on the GPU), with the copy / GEMM
#      ceilings and the weight-read floor measured in the same process;
#   3. the HF transformers eager reference (torch_reference_eager.py) for the same shapes.
#   4. "fused": the fused-kernel check (paged attention vs dense f32 reference, skinny
#      matmuls with folded-in norms/silu/residual adds vs the separate kernels, fused vs plain
#      logits); "ablate": the 0.6B step with CUDA graphs / fused kernels / the per-group
#      attention kernel / the folded skinny matmuls off, for comparison;
#   5. end-to-end routing throughput (scripts/gpu_routing.py: serve + bench, random p = 0.35);
#   7. "structured" (not in the default STEPS): structured output on the 0.6B shape, masks on
#      the device vs on the host, free vs json_object / schema / regex (scripts/gpu_structured.py);
#      with STRUCTURED_ARGS="--switch sampling --temperature 0.8 --top-p 0.95": sampled rows
#      drawn on the device vs on the host instead;
#   8. "constrained" (not in the default STEPS): routing under a constraint on the 0.6B / 8B
#      shapes, R-Stitch vs never routed, free / regex / schema (scripts/gpu_constrained_routing.py);
#   6. "remote" (not in the default STEPS): the 32B served by `tokenrouter subserver` in a
#      second process on the same GPU vs in-process (scripts/bench_remote.py).
# Logs go to $OUT; a short table is printed last. STEPS picks sections (default all:
# "check fused nomma ablate profile ours hf routing"; "nomma": steps with attention on CUDA
# cores instead of tensor cores; "nopdl": steps without programmatic dependent launch; "matmul": the skinny matmuls of MATMUL_MODELS alone at 1-64
# rows, cuBLAS vs our gemv; "profile": GPU time per kernel of eager 1-2 row decode steps of
# PROFILE_MODELS); ROUTING_ARGS is passed to gpu_routing.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
G=.gpu
BIN=$(mktemp /tmp/tokenrouter.XXXXXX)   # one copy per run: scripts/gpu_table_x2.sh runs two at once
if [ -f $G/tokenrouter.xz ]; then xz -dc $G/tokenrouter.xz > $BIN; else cp $G/tokenrouter $BIN; fi
chmod +x $BIN
RUN="bash $G/run-on-gpu.sh $BIN"
WRAP=$BIN-wrapped   # $RUN as one executable, for scripts that take a binary
printf '#!/usr/bin/env bash\nexec bash %s %s "$@"\n' "$PWD/$G/run-on-gpu.sh" "$BIN" > $WRAP
chmod +x $WRAP
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/env.txt

STEPS=${STEPS:-check fused nomma ablate profile ours hf routing}
has() { [[ " $STEPS " == *" $1 "* ]]; }

if has remote; then
echo "== 6. the 32B in a second process on the same GPU vs both in-process (scripts/bench_remote.py)"
python3 scripts/bench_remote.py --bin "$RUN" --config config/random/Qwen3-0.6B_Qwen3-32B_random-weights.yaml \
  --set model.reference.delayed_batching_threshold=1 --concurrency ${REMOTE_CONCURRENCY:-1 8 16} \
  --prompts 16 --max-tokens ${REMOTE_MAX_TOKENS:-128} --out $OUT/remote 2>&1 | tee $OUT/remote.txt | tail -12
fi

if has structured; then
echo "== 7. structured output: masks on the device vs on the host (scripts/gpu_structured.py)"
python3 scripts/gpu_structured.py --bin $WRAP --out $OUT/structured ${STRUCTURED_ARGS:-} 2>&1 | tee $OUT/structured.txt | tail -20
fi

if has constrained; then
echo "== 8. routing under a constraint: R-Stitch's entropy over the allowed tokens (scripts/gpu_constrained_routing.py)"
python3 scripts/gpu_constrained_routing.py --bin $WRAP --out $OUT/constrained ${CONSTRAINED_ARGS:-} 2>&1 | tee $OUT/constrained.txt | tail -24
fi

if has check; then
echo "== 1. correctness vs HF transformers"
CK=/tmp/ck; rm -rf $CK
python3 scripts/gpu_check_hf.py make $CK 2>&1 | tail -2
$RUN bench-model --check-logits $CK --ids-file $CK/ids.json --logits-out $CK/ours.bin --device cuda:0 2>&1 | tail -3
python3 scripts/gpu_check_hf.py compare $CK 2>&1 | grep -v Warning | tee $OUT/check.txt | tail -5
fi

if has fused; then
echo "== 4. fused kernels: checks against references"
timeout 120 $RUN bench-model --check-fused config/shapes/qwen3-0.6b.json --device cuda:0 2>&1 | tee $OUT/check_fused.txt | grep -v '^== ldd\|^== LD\|lib'
fi

# A tensor-core attention kernel that fails its check is switched off for the rest of the
# run, so the call still measures everything else.
if [ -f $OUT/check_fused.txt ] && ! awk '/^CHECK attention_kernel Mma /{exit !($5 + 0 < 0.05)}' $OUT/check_fused.txt; then
  echo "tensor-core attention check failed: TOKENROUTER_ATTN_MMA=0 for this run"
  export TOKENROUTER_ATTN_MMA=0
fi

if has matmul; then
echo "== 4d. skinny matmuls at 1-64 rows: cuBLAS vs ours (GB/s of weights read)"
for m in ${MATMUL_MODELS:-qwen3-32b}; do
  timeout 200 $RUN bench-model --matmul-bench config/shapes/$m.json --device cuda:0 2>&1 | tee $OUT/matmul_$m.txt | grep '^|'
done
fi

if has nomma; then
echo "== 4c. steps with attention on CUDA cores (one block per query head) instead of tensor cores"
for m in qwen3-0.6b qwen3-32b; do
  TOKENROUTER_ATTN_MMA=0 timeout 200 $RUN bench-model --random-weights config/shapes/$m.json --device cuda:0 2>&1 | tee $OUT/nomma_$m.txt | grep '^|'
done
fi

if has nopdl; then
echo "== 4e. steps without programmatic dependent launch (TOKENROUTER_PDL=0, same binary)"
for m in qwen3-0.6b qwen3-32b; do
  TOKENROUTER_PDL=0 timeout 240 $RUN bench-model --random-weights config/shapes/$m.json --device cuda:0 2>&1 | tee $OUT/nopdl_$m.txt | grep '^|'
done
fi

if has ablate; then
echo "== 4b. the 0.6B step without graphs / fused kernels / per-group attention, 1-2 rows without folded skinny matmuls"
TOKENROUTER_CUDA_GRAPHS=0 timeout 100 $RUN bench-model --random-weights config/shapes/qwen3-0.6b.json --device cuda:0 --batches 1,4,16 2>&1 | tee $OUT/nographs_0.6b.txt | grep '^|'
TOKENROUTER_FUSED_KERNELS=0 timeout 100 $RUN bench-model --random-weights config/shapes/qwen3-0.6b.json --device cuda:0 --batches 1,4,16 2>&1 | tee $OUT/plain_0.6b.txt | grep '^|'
TOKENROUTER_ATTN_TILES=1 timeout 100 $RUN bench-model --random-weights config/shapes/qwen3-0.6b.json --device cuda:0 --batches 1,4,16 2>&1 | tee $OUT/tiles_0.6b.txt | grep '^|'
TOKENROUTER_FUSED_GEMV=0 timeout 100 $RUN bench-model --random-weights config/shapes/qwen3-0.6b.json --device cuda:0 --batches 1,2 2>&1 | tee $OUT/nofold_0.6b.txt | grep '^|'
fi

if has profile; then
echo "== 6. GPU time per kernel of one eager decode step (1 and 2 rows)"
for m in ${PROFILE_MODELS:-qwen3-0.6b qwen3-32b}; do
  timeout 150 $RUN bench-model --random-weights config/shapes/$m.json --device cuda:0 --batches 1,2 --decode-tokens 5 --prefill-tokens 64 --op-profile 2>&1 | tee $OUT/profile_$m.txt | grep '^|'
done
fi

if has ours; then
echo "== 2. our benchmarks"
timeout 150 $RUN bench-model --random-weights config/shapes/qwen3-0.6b.json --device cuda:0 --ceilings 2>&1 | tee $OUT/ours_0.6b.txt | grep -v '^== ldd\|^== LD\|lib' 
timeout 240 $RUN bench-model --random-weights config/shapes/qwen3-32b.json --device cuda:0 --ceilings 2>&1 | tee $OUT/ours_32b.txt | grep -v '^== ldd\|^== LD\|lib'
fi

if has hf; then
echo "== 3. HF eager reference"
timeout ${HF_TIMEOUT:-200} python3 $G/torch_reference_eager.py 2>&1 | grep -v Warning > $OUT/hf_eager.txt
grep -E "copy|gemm|HF eager|^\{" $OUT/hf_eager.txt
fi

if has routing; then
echo "== 5. end-to-end routing"
python3 scripts/gpu_routing.py --bin $WRAP --out $OUT/routing ${ROUTING_ARGS:-} 2>&1 | tee $OUT/routing.txt | tail -12
fi

echo "== SUMMARY"
grep -h "^CHECK" $OUT/check.txt 2>/dev/null | cut -c1-400
python3 - "$OUT" <<'PY'
import json, sys, re, glob
out = sys.argv[1]
hf = {}
try:
    for l in open(f"{out}/hf_eager.txt"):
        if l.startswith("{"): hf = json.loads(l)
except Exception: pass
print("| model | floor ms | bs1 | bs2 | bs4 | bs8 | bs16 | bs32 | extend 512 | HF eager bs1 / bs4 / bs16 |")
print("|---|---|---|---|---|---|---|---|---|---|")
for f in sorted(glob.glob(f"{out}/ours_*.txt")):
    for l in open(f):
        if l.startswith("RESULT "):
            r = json.loads(l[7:]); m = r["model"]
            d = {x["batch"]: x["ms"] for x in r["decode_ms"]}
            h = " / ".join(f'{hf.get(f"{m}/bs{b}", float("nan")):.1f}' for b in (1, 4, 16))
            print(f'| {m} | {r["floor_ms"]:.2f} | ' + " | ".join(f'{d.get(b, float("nan")):.2f}' for b in (1,2,4,8,16,32))
                  + f' | {r["extend_ms"]:.1f} | {h} |')
            print(f'<!-- {m}: copy {r["copy_gbs"]:.0f} GB/s, GEMM {r["gemm_tflops"]:.0f} TFLOP/s, weights {r["weight_gb"]:.2f} GB, load {r["load_s"]:.1f}s -->')
PY
