#!/bin/bash
# The start by host load: OLD = .ab_old (HEAD, the convoy start for client processes), NEW = this
# tree (not waiting while the host's CPUs have room). Heterogeneous decoders, GPU executor.
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
HET="--scenarios inference --policies opportunistic immediate"
run het_new . 85 $HET
run het_old .ab_old 85 $HET
uptime
