#!/bin/bash
# Second part of the A/B (device_ab2.sh): mixed with the convoy fixed beside the adaptive rule, old
# and new, then the heterogeneous case again on the new tree with the convoy fixed too.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
run() {
  tag=$1; dir=$2; limit=$3; shift 3
  start=$(date +%s)
  (cd "$dir" && PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 -m benchmarks.batching --clients-as processes \
     --executor-device cuda --repeats 1 "$@" --output "$OUT/$tag" > "$OUT/$tag.log" 2>&1)
  echo "== $tag rc=$? $(( $(date +%s) - start )) s"
  rm -f "$OUT/$tag"/*.png
  grep -E "^\[[0-9]\]" "$OUT/$tag.log" | cut -c1-220
}
MIX="--scenarios inference_alone inference_with_finetune --policies opportunistic opportunistic-convoy"
run mix2_new . 130 $MIX
run mix2_old .ab_old 130 $MIX
run het2_new . 120 --scenarios inference --policies opportunistic immediate lockstep opportunistic-convoy
uptime
