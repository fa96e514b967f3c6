#!/usr/bin/env bash
# Issue 4's GPU checks in one call on a lent GPU machine (a bare image with torch, transformers and
# grpcio; nothing downloaded): the CUDA tests, decode step time against the bandwidth roofline, and
# throughput at 64 streams against transformers' generate_batch, on a Llama-3-8B-shaped model with
# dummy bf16 weights. Logs and JSON go to $OUT (or bench/results/gpu-<time>).
#
# What the machine lacks travels in .gpu/ (ignored by git; made by `make gpu-bundle`, bench/gpu_bundle.sh):
#   .gpu/whl/*.whl   wheels of the Python packages the image lacks
#   .gpu/pb2/        the generated gRPC modules (tokenwire/v1/*_pb2*.py)
#   .gpu/smollm2/    SmolLM2's config and tokenizer (no weights; the tests' TOKENWIRE_TEST_MODEL_DIR)
#   .gpu/llama3-8b/  bench.model_shapes' Llama-3-8B config with SmolLM2's tokenizer
#
#   bash bench/gpu_session.sh [phase ...]    phases: env tests roofline roofline_torch engine hf stack gemv
#                                            (default: env tests roofline engine hf stack)
set -u
OUT=${OUT:-bench/results/gpu-$(date -u +%Y%m%dT%H%M%S)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SHAPE=${SHAPE:-.gpu/llama3-8b}
STREAMS=${STREAMS:-64}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-200}
PROMPT_LEN=${PROMPT_LEN:-32}
ENGINE_FLAGS=${ENGINE_FLAGS:---model $SHAPE --load-format dummy --max-num-seqs $STREAMS --max-model-len 1024 --cuda-graphs}

if [ -d .gpu/whl ] && ls .gpu/whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
    >"$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail -5 "$OUT/pip.log"; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -d .gpu/pb2 ] && ! ls tokenwire/v1/*_pb2.py >/dev/null 2>&1; then cp .gpu/pb2/* tokenwire/v1/; fi

phase() {  # phase NAME SECONDS COMMAND...: runs COMMAND with a limit, its output in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local began=$SECONDS
  echo "=== $name: $*"
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - began)) s"
  tail -n "${TAIL_LINES:-15}" "$OUT/$name.log"
}

run_env() {
  phase env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv; \
    $PY -c 'import torch, transformers, grpc, google.protobuf as pb; print(torch.__version__, transformers.__version__, grpc.__version__, pb.__version__, torch.cuda.get_device_name())'; \
    $PY -c 'import model_worker.servicer, gateway.app, detok_worker.servicer; print(\"imports ok\")'; \
    $PY -c 'import inspect; from transformers.generation.configuration_utils import ContinuousBatchingConfig as C; print(inspect.signature(C.__init__))'"
}

run_tests() {
  TOKENWIRE_TEST_MODEL_DIR=.gpu/smollm2 phase tests 300 $PY -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_cuda_graphs.py tests/test_cuda_host_syncs.py tests/test_sampler.py --timeout 240
  TOKENWIRE_TEST_MODEL_DIR=.gpu/smollm2 phase triton_tests 300 $PY -m pytest -q -p no:cacheprovider \
    tests/test_triton_ops.py --timeout 240
}

run_gemv() {
  phase gemv 200 $PY -m bench.bench_cuda_gemv --rows 1,8
}

run_roofline() {
  phase roofline 300 $PY -m bench.decode_roofline --model-dir "$SHAPE" --batch-sizes 1,8,64 --context 512 \
    --profile-steps "${PROFILE_STEPS:-0}" --kernel-profile-steps "${KERNEL_PROFILE_STEPS:-0}" --json "$OUT/roofline.json" \
    ${ROOFLINE_ARGS:-}
}

run_roofline_torch() {  # the same, on torch ops (before the Triton kernels), for a same-session ratio
  phase roofline_torch 300 $PY -m bench.decode_roofline --model-dir "$SHAPE" --batch-sizes 1,8,64 --context 512 \
    --no-cuda-kernels --json "$OUT/roofline_torch.json"
}

WORK="--concurrency 1,$STREAMS --output-tokens $OUTPUT_TOKENS --prompt-len $PROMPT_LEN"

run_engine() {
  # shellcheck disable=SC2086
  phase engine_alone 240 $PY -m bench.engine_alone $WORK --json "$OUT/engine_alone.json" -- $ENGINE_FLAGS
}

run_hf() {
  # shellcheck disable=SC2086
  phase hf_continuous 300 $PY -m bench.hf_baselines --mode continuous --model "$SHAPE" --load-format dummy \
    --device ${HF_DEVICE:-cuda} --dtype bfloat16 $WORK --json "$OUT/hf_continuous.json"
}

run_throughput() { run_engine; run_hf; }

run_stack() {
  local port=8123
  # shellcheck disable=SC2086
  $PY -m tokenwire.stack --port $port -- $ENGINE_FLAGS >"$OUT/stack.log" 2>&1 &
  local stack=$!
  for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1 && break
    kill -0 $stack 2>/dev/null || break
    sleep 2
  done
  phase loadgen 240 $PY -m bench.loadgen --base-url "http://127.0.0.1:$port/v1" --tokenizer "$SHAPE" \
    --prompt-format ids --concurrency 1,$STREAMS --output-tokens "$OUTPUT_TOKENS" --prompt-len "$PROMPT_LEN" \
    --label "tokenwire (gateway)" --json "$OUT/loadgen.json"
  kill -INT $stack 2>/dev/null; sleep 5; kill -9 $stack 2>/dev/null
  tail -n 20 "$OUT/stack.log"
}

phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(env tests roofline engine hf stack)
for p in "${phases[@]}"; do "run_$p"; done
# A lent machine returns at most 8 files: the logs travel as one archive.
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
echo "=== logs in $OUT/logs.tgz"
