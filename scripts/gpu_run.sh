#!/usr/bin/env bash
# On a GPU machine without registry access: install capturepass (and carried wheels)
# into /tmp/site, then run the GPU tests and, optionally, the benchmarks.
#   bash scripts/gpu_run.sh tests|zoo|bench|zoobench|uncaptured|pickcheck|memory|resident|resources|sanitize|heap|crash|trace|sweep|all [OUTDIR]
# tests: every GPU test (the model zoo's in parallel processes when pytest-xdist is there).
# zoo: scripts/zoo_table.py, the zoo under capturepass, Inductor and reduce-overhead (zoo.md, zoo.json).
# zoobench: bench/zoo.py on the zoo's decoders at realistic sizes (Inductor, reduce-overhead, capturepass,
# capturepass policy="off"; PROCS processes per cell, 3 by default), with the peak's allocation sites in
# each worker's log (OUTDIR/zoo-bench/logs). Not part of all.
# uncaptured: bench/host_overhead.py at bench/zoo.py's sizes (MODELS: gpt2,llama,qwen2_moe by default),
# Inductor, capturepass uncaptured and capturepass uncaptured on one lane in one process per model
# (the uncaptured bar, at most 1.10; OUTDIR/uncaptured.txt). Not part of all.
# pickcheck: bench/pick_check.py, the measured choice's figures against each schedule's graph
# replayed alone (one process per model and shape). Not part of all.
# memory: bench/memory.py, the MoE block at MEMORY_SIZES (8,32,67 by default) batch sizes: memory held and
# peak against reduce-overhead, each worker with empty caches; MEMORY_SITES=1: where each segment outside a
# graph pool was made (--sites). Not part of all.
# trace: a measured trace of the MoE demo (capturepass.trace: its CUDA graph replays, then its
# uncaptured program), with per-lane kernel counts, busy time and overlap; the GPU trace tests;
# and `capturepass show --trace` reading the measured run back from the dump. Not part of all.
# sweep: scripts/arch_sweep.py on the GPU in SWEEP_PROCS processes at once (8 by default; SWEEP_DEADLINE:
# seconds each run may take, then the models not reached are named): the runs in SWEEP_RUNS, by default
# every decoder generating through real captures (generate), then every model with FlexAttention (flex);
# plain: every model's three calls against eager. MODELS limits them. Not part of all.
# heap: the held-output expiry test (torch without UntypedStorage._swap_data_ptr_) and then the
# static-cache generation tests in one process (HEAP_TESTS: other tests), HEAP_REPS times (3 by
# default; 0: none) under glibc's malloc checking where the machine has it (glibc's message on
# stderr: LIBC_FATAL_STDERR_, else it goes to the terminal); then HEAP_VARIANTS' generations outside
# pytest, VARIANT_REPS times each, BREAKABLE_VARIANTS' runs of scripts/breakable_replay.py and
# HEAP_GDB's generations under cuda-gdb (below); then once under compute-sanitizer memcheck
# (HEAP_MEMCHECK=0: not). Processes that ran them aborted with a corrupted heap until a capture
# stopped letting go of host input buffers (RELIABILITY.md). Not part of all.
# crash: the static-cache generations of MODELS (modernbert-decoder by default) under capturepass,
# Inductor and reduce-overhead, then capturepass's under cuda-gdb (a process that died collecting garbage
# after its generations passed: RELIABILITY.md). Not part of all.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
out=${2:-${OUT:-/tmp/capturepass-out}}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . .whl/*.whl >/dev/null 2>&1 \
  || python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . .whl/*.whl
export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests --ignore=tests/test_zoo.py 2>&1 \
    | tee "$out/gpu-tests.log" | tail -40
  rc=${PIPESTATUS[0]}
  xdist=""
  python3 -c 'import xdist' 2>/dev/null && xdist="-n ${ZOO_JOBS:-8}"
  python3 -m pytest -q -rs -p no:cacheprovider -m gpu $xdist tests/test_zoo.py 2>&1 \
    | tee "$out/gpu-zoo-tests.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  python3 examples/moe_shared_expert.py --device cuda 2>&1 | tail -12
fi
if [ "$what" = zoo ] || [ "$what" = all ]; then
  python3 scripts/zoo_table.py --jobs "${ZOO_JOBS:-8}" --timeout "${ZOO_TIMEOUT:-400}" --json "$out/zoo.json" \
    > "$out/zoo.md" 2> "$out/zoo.log"
  echo "zoo_table: exit $?"; cat "$out/zoo.md"
fi
if [ "$what" = sanitize ] || [ "$what" = all ]; then
  # The example end to end, then subsets of the GPU tests (two owners, breakable capture, deferred release;
  # owner-bound channels and workspaces, an external stream, the join level).
  for tool in racecheck memcheck; do
    compute-sanitizer --tool $tool --print-limit 20 python3 examples/moe_shared_expert.py --device cuda --small \
      > "$out/sanitizer-$tool.log" 2>&1
    echo "compute-sanitizer $tool (example): exit $?; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer-$tool.log" | tail -1)"
    compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_cuda_runtime.py \
      -k "target_and_draft or breakable_capture or deferred_release or attention" > "$out/sanitizer-tests-$tool.log" 2>&1
    echo "compute-sanitizer $tool (tests): exit $?; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer-tests-$tool.log" | tail -1); $(grep -E 'passed|failed' "$out/sanitizer-tests-$tool.log" | tail -1)"
    compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_cuda_resources.py \
      -k "target_and_draft or external_stream_joined or join_level" > "$out/sanitizer-resources-$tool.log" 2>&1
    echo "compute-sanitizer $tool (resource tests): exit $?; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer-resources-$tool.log" | tail -1); $(grep -E 'passed|failed' "$out/sanitizer-resources-$tool.log" | tail -1)"
  done
fi
if [ "$what" = heap ]; then
  heap_tests=${HEAP_TESTS:-"tests/runtime/test_outputs_gpu.py::test_an_output_held_outside_pythons_heap_raises_on_access_instead_of_being_overwritten tests/test_generate.py::test_generate_with_a_static_cache_gpu"}
  debug=/lib/x86_64-linux-gnu/libc_malloc_debug.so.0
  # HEAP_PERTURB=N: glibc fills freed memory with byte N (and new memory with its complement), so
  # that a reader of freed memory fails nearer the culprit than the next allocation does.
  perturb=()
  [ -n "${HEAP_PERTURB:-}" ] && perturb=(MALLOC_PERTURB_="$HEAP_PERTURB")
  checked() {  # the command under glibc's malloc checking where the machine has it
    if [ -e "$debug" ]; then
      env LD_PRELOAD=$debug MALLOC_CHECK_=3 LIBC_FATAL_STDERR_=1 "${perturb[@]}" "$@"
    else
      "$@"
    fi
  }
  for i in $(seq "${HEAP_REPS:-3}"); do
    # -s: pytest's capture of fd 2 would take glibc's message with it when the process aborts.
    # shellcheck disable=SC2086
    checked python3 -X faulthandler -m pytest -q -s -p no:cacheprovider -p no:xdist $heap_tests > "$out/heap-$i.log" 2>&1
    echo "heap run $i: exit $?; $(grep -E 'passed|failed|corrupted|Fatal|malloc|free\(\)|terminate' "$out/heap-$i.log" | tail -4 | tr '\n' ' ')"
    # The generated module the aborting thread was in (Inductor's cache is outside OUTDIR), and its line.
    where=$(grep -A1 -m1 '^Current thread' "$out/heap-$i.log" | grep -oE '/tmp/torchinductor[^"]*\.py", line [0-9]+')
    if [ -n "$where" ]; then
      file=${where%%\"*}; line=${where##* }
      cp "$file" "$out/heap-$i-module.py"
      echo "  in $(basename "$file") line $line: $(sed -n "${line}p" "$file" | sed 's/^ *//')"
    fi
  done
  # HEAP_VARIANTS: the test's generations by scripts/static_generations.py, fresh processes, each
  # variant VARIANT_REPS times under the same checking; variants are BACKEND, capturepass|OPTIONS_JSON
  # or capturepass|OPTIONS_JSON|MORE_ARGS (the script's --declare, --without), separated by ';'
  # (e.g. 'capturepass|{};capturepass|{"policy":"off"};capturepass|{}|--without weak-args;inductor').
  # HEAP_MODELS: the models they generate with (the script's three by default).
  IFS=';' read -r -a variants <<< "${HEAP_VARIANTS:-}"
  for variant in "${variants[@]}"; do
    IFS='|' read -r backend options more <<< "$variant"
    options=${options:-'{}'}
    models=()
    [ -n "${HEAP_MODELS:-}" ] && models=(--models "$HEAP_MODELS")
    for i in $(seq "${VARIANT_REPS:-3}"); do
      log="$out/heap-variant-$(echo "$variant" | tr -dc 'a-z0-9')-$i.log"
      # shellcheck disable=SC2086
      checked python3 -X faulthandler scripts/static_generations.py --backend "$backend" --options "$options" \
        "${models[@]}" $more > "$log" 2>&1
      echo "$variant run $i: exit $?; $(grep -E '^(OK|FAIL)|malloc|free\(\)|Fatal' "$log" | tr '\n' ' ' | cut -c1-300)"
    done
  done
  # BREAKABLE_VARIANTS: scripts/breakable_replay.py (the pattern, small: segments replayed with an
  # op run eagerly between them) under the same checking, VARIANT_REPS times each; variants are its
  # arguments, separated by ';' (e.g. '--mode torch;--mode capturepass;--mode capturepass --without let-go').
  IFS=';' read -r -a breakable <<< "${BREAKABLE_VARIANTS:-}"
  for variant in "${breakable[@]}"; do
    for i in $(seq "${VARIANT_REPS:-3}"); do
      log="$out/breakable-$(echo "$variant" | tr -dc 'a-z0-9')-$i.log"
      # shellcheck disable=SC2086
      checked python3 -X faulthandler scripts/breakable_replay.py --device cuda $variant > "$log" 2>&1
      echo "breakable $variant run $i: exit $?; $(grep -E '^(OK|FAIL)|malloc|free\(\)|Fatal' "$log" | tr '\n' ' ' | cut -c1-300)"
    done
  done
  # HEAP_GDB: arguments of scripts/static_generations.py run under cuda-gdb with the same checking,
  # GDB_REPS times (2 by default): the native stack where glibc finds the heap corrupted (a later
  # allocation than the write, but whose: the caching allocator's, the driver's, Python's?).
  if [ -n "${HEAP_GDB:-}" ] && command -v cuda-gdb >/dev/null; then
    for i in $(seq "${GDB_REPS:-2}"); do
      gdb_env=(-ex "set environment MALLOC_CHECK_=3" -ex "set environment LIBC_FATAL_STDERR_=1")
      [ -e "$debug" ] && gdb_env+=(-ex "set environment LD_PRELOAD=$debug")
      [ -n "${HEAP_PERTURB:-}" ] && gdb_env+=(-ex "set environment MALLOC_PERTURB_=$HEAP_PERTURB")
      # shellcheck disable=SC2086
      timeout "${HEAP_GDB_TIMEOUT:-300}" cuda-gdb -batch "${gdb_env[@]}" \
        -ex "handle SIGUSR1 SIGUSR2 SIGPIPE SIGCHLD nostop noprint pass" -ex run -ex bt -ex "info threads" \
        --args python3 scripts/static_generations.py $HEAP_GDB > "$out/heap-gdb-$i.log" 2>&1
      echo "cuda-gdb run $i: exit $?; $(grep -E '^(OK|FAIL)' "$out/heap-gdb-$i.log" | tr '\n' ' ')"
      grep -E -A30 'received signal' "$out/heap-gdb-$i.log" | head -40
    done
  fi
  # shellcheck disable=SC2086
  if [ "${HEAP_MEMCHECK:-1}" != 0 ]; then
    compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -q -p no:cacheprovider -p no:xdist $heap_tests \
      > "$out/heap-memcheck.log" 2>&1
    echo "compute-sanitizer memcheck (heap tests): exit $?; $(grep -E 'ERROR SUMMARY' "$out/heap-memcheck.log" | tail -1)"
  fi
fi
if [ "$what" = crash ]; then
  # The ModernBERT decoder's static-cache generations passed and then the process died collecting
  # garbage (RELIABILITY.md): under each backend (is it capturepass's?), then capturepass's under
  # cuda-gdb for the native frames (the machine has no gdb).
  crash_models=${MODELS:-modernbert-decoder}
  for backend in capturepass inductor reduce-overhead; do
    python3 -X faulthandler scripts/arch_sweep.py --device cuda --generate --backend $backend --models "$crash_models" \
      > "$out/crash-$backend.log" 2>&1
    echo "generation under $backend: exit $?; $(grep -E '^(OK|FAIL|TORCH|SKIP)|Fatal Python' "$out/crash-$backend.log" | tr '\n' ' ')"
  done
  if command -v cuda-gdb >/dev/null; then
    # Signals Python and the CUDA runtime use for themselves pass through; a fatal one stops it.
    timeout "${CRASH_GDB_TIMEOUT:-400}" cuda-gdb -batch -ex "handle SIGUSR1 SIGUSR2 SIGPIPE SIGCHLD nostop noprint pass" \
      -ex run -ex bt -ex "info threads" --args python3 scripts/arch_sweep.py --device cuda --generate \
      --models "$crash_models" > "$out/crash-cuda-gdb.log" 2>&1
    echo "cuda-gdb: exit $?"; grep -E -A40 'received signal|SIGSEGV|SIGABRT' "$out/crash-cuda-gdb.log" | head -60
  fi
fi
if [ "$what" = resources ] || [ "$what" = all ]; then
  python3 examples/engine_resources.py --device cuda 2>&1 | grep -v DEBUG | tail -12
  python3 bench/profiling_capture.py 2>&1 | grep -v DEBUG | tail -8
fi
if [ "$what" = resident ] || [ "$what" = all ]; then
  python3 bench/resident_grid.py --out "$out" 2>&1 | grep -v DEBUG | tail -12
fi
if [ "$what" = trace ]; then
  # Dumps stay outside OUTDIR (many files); their graph.json and measured.json are copied into it.
  dumps=$(mktemp -d /tmp/capturepass-trace-XXXX)
  python3 examples/moe_shared_expert.py --device cuda --dump "$dumps/replay" --trace "$out/moe-trace.json" \
    --profiler-trace "$out/moe-profiler.json.gz" 2>&1 | grep -v DEBUG | tail -10
  rc=${PIPESTATUS[0]}
  python3 -m capturepass show "$dumps/replay" --trace "$out/moe-show-trace.json" | tail -1
  python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/measure/test_measure.py 2>&1 | tee "$out/trace-tests.log" | tail -3
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  python3 examples/moe_shared_expert.py --device cuda --dump "$dumps/uncaptured" --uncaptured \
    --trace "$out/moe-trace-uncaptured.json" --profiler-trace "$out/moe-profiler-uncaptured.json.gz" 2>&1 \
    | grep -v DEBUG | tail -8
  for mode in replay uncaptured; do
    for f in graph.json measured.json; do cp "$dumps/$mode"/*/"$f" "$out/moe-$mode-$f" 2>/dev/null; done
  done
fi
if [ "$what" = zoobench ]; then
  python3 bench/zoo.py --models "${ZOO_MODELS:-llama,qwen2_moe}" \
    --variants inductor,reduce-overhead,capturepass,capturepass-off --procs "${PROCS:-3}" --memory-sites \
    --out "$out/zoo-bench" > "$out/zoo-bench.log" 2>&1
  rc=$?
  echo "bench/zoo.py: exit $rc"; cat "$out/zoo-bench/zoo-bench.md" 2>/dev/null
fi
if [ "$what" = uncaptured ]; then
  for model in $(echo "${MODELS:-gpt2,llama,qwen2_moe}" | tr ',' ' '); do
    python3 bench/host_overhead.py --device cuda --sizes real --model "$model" --rounds "${ROUNDS:-10}" 2>&1 \
      | grep -v DEBUG | tail -9 | tee -a "$out/uncaptured.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
fi
if [ "$what" = pickcheck ]; then
  python3 bench/pick_check.py --models "${ZOO_MODELS:-llama,qwen2_moe}" --out "$out" 2> "$out/pick-check.log"
  rc=$?
fi
if [ "$what" = memory ]; then
  python3 bench/memory.py --sizes "${MEMORY_SIZES:-8,32,67}" ${MEMORY_SITES:+--sites} --out "$out/memory" 2> "$out/memory.log"
  rc=$?
  echo "bench/memory.py: exit $rc"
fi
if [ "$what" = sweep ]; then
  models=${MODELS:+--models $MODELS}
  shards=(--procs "${SWEEP_PROCS:-8}" ${SWEEP_DEADLINE:+--deadline $SWEEP_DEADLINE})
  for run in ${SWEEP_RUNS:-generate flex}; do
    case $run in
      plain) flags=() ;;
      generate) flags=(--generate) ;;
      flex) flags=(--attn flex_attention) ;;
      *) echo "SWEEP_RUNS: unknown run $run (plain, generate, flex)"; rc=1; continue ;;
    esac
    python3 scripts/arch_sweep.py --device cuda "${flags[@]}" "${shards[@]}" $models > "$out/sweep-$run.log" 2>&1
    status=$?
    [ $status = 0 ] || rc=1
    echo "arch_sweep ($run): exit $status"; grep -E '^(FAIL|TORCH|SLOW|CRASH)|equal to eager' "$out/sweep-$run.log"
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 bench/overlap.py --procs "${PROCS:-3}" --budget-s "${BUDGET_S:-0}" --out "$out" ${WORKLOADS:+--workloads $WORKLOADS}
fi
exit $rc
