# Sourced by the device_ab*.sh scripts: installs the wheels carried in .whl (see ../README.md,
# "Re-running it in a lease") and defines run TAG DIR LIMIT ARGS...: one invocation of the
# batching benchmark from the tree in DIR (client processes, executor on the GPU, one repeat),
# cut at LIMIT seconds; its JSON in $OUT/TAG, its log in $OUT/TAG.log, its result lines printed.
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
