# Sourced at the start of a GPU call (bench/NEXT_GPU.md): installs the carried wheels, sets the
# environment, and defines
#   s NAME CAP CMD...   a step capped at CAP seconds and never past the call's deadline (DEADLINE,
#                       default 560 s), its output appended to $OUT/$LANE.log
#   lane NAME GPU       the steps after it run on that GPU and log to $OUT/NAME.log
# Two lanes in ( ... ) & subshells, each pinned to half the cores with taskset, use both GPUs of a
# two-GPU host at once (the 26th session's calls: bench/NOTES.md section 12).
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 UNSLOTH_DISABLE_STATISTICS=1
D=$((SECONDS+${DEADLINE:-560}))
s(){ n=$1 c=$2; shift 2; r=$((D-SECONDS)); [ $r -ge 30 ] || { echo "[$LANE] $n: skipped, ${r}s left" | tee -a $OUT/$LANE.log; return; }
  echo "=== $n (gpu $CUDA_VISIBLE_DEVICES, start ${SECONDS}s)" >>$OUT/$LANE.log
  timeout $((r<c?r:c)) "$@" >>$OUT/$LANE.log 2>&1; echo "[$LANE] $n: rc=$? at ${SECONDS}s" | tee -a $OUT/$LANE.log; }
lane(){ export LANE=$1 CUDA_VISIBLE_DEVICES=$2; shift 2; }
