#!/bin/bash
# A/B on the H200 host, executor on the GPU, client processes: OLD = .ab_old (c5dc90d, before the
# at-once rule change), NEW = this tree. Heterogeneous decoders (3 policies) and mixed (alone /
# beside fine-tuning), single runs, interleaved.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
nproc; nvidia-smi -L
run() {
  tag=$1; dir=$2; limit=$3; shift 3
  start=$(date +%s)
  (cd "$dir" && PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m benchmarks.batching --clients-as processes \
     --executor-device cuda --repeats 1 "$@" --output "$OUT/$tag" > "$OUT/$tag.log" 2>&1)
  echo "== $tag rc=$? $(( $(date +%s) - start )) s"
  rm -f "$OUT/$tag"/*.png
  grep -E "^\[[0-9]\]" "$OUT/$tag.log" | cut -c1-220
}
HET="--scenarios inference --policies opportunistic immediate lockstep"
MIX="--scenarios inference_alone inference_with_finetune --policies opportunistic"
run het_old .ab_old 120 $HET
run het_new . 120 $HET
run mix_old .ab_old 100 $MIX
run mix_new . 100 $MIX
uptime
