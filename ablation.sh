#!/usr/bin/env bash
# The paper's ablation, one command, install to REPORT.md. On the embedded default (a CPU machine, root; no GPU, no
# internet but the Debian and PyPI mirrors): build the sandbox base image, pre-train a small base model on terminal
# sessions, generate the toy corpus and disjoint RL / evaluation tasks (the held-out kind only in evaluation), SFT two
# arms from that base (ActionSFT λ=0, ActObs λ=1), the same GRPO recipe from each, pass@k of every checkpoint on the
# held-out tasks, the probes, and one run folder with REPORT.md (tables with paired bootstrap intervals) and the
# plots. --all adds the paper's other comparisons: the Obs→Act arm (SFT, GRPO, evaluation), GRPO from ActionSFT with
# ECHO (an observation loss on its own rollouts), and ActionSFT + GRPO again at the temperature T* where its
# self-entropy matches ActObs + GRPO's.
#
#   bash ablation.sh              # the main job -> runs/ablation/     (RUN_DIR=... to write elsewhere)
#   bash ablation.sh --all        # also Obs→Act, ECHO and T*: ~1.8x the main job's time
#   bash ablation.sh --quick      # smaller everything, same code path -> runs/ablation-quick/
#   SEED=1 bash ablation.sh       # another draw of everything seeded (base, corpus and tasks, SFT order, rollouts):
#                                 # a replicate, in its own RUN_DIR
#   bash ablation.sh --sweep      # also SFT arms at λ = 0.25 and 0.5 (--sweep=0.1,0.75: those), each through the
#                                 # same GRPO and evaluation; the report plots their advantage over ActionSFT
#                                 # against λ. Quick sweeps λ = 0.5 only; CI runs `--quick --all --sweep`.
#
# With a real model (a GPU node; every GPU through torchrun): the model, Nemotron-Terminal-Corpus rows, Terminal-Bench
# 2.0 and aider-polyglot to evaluate on, Endless Terminals' solvable tasks to train GRPO on (scripts/fetch.py: fetched
# once, or local paths), then the same stages into runs/real-<preset>/, its plan printed first (scripts/plan.py):
#
#   bash ablation.sh --model Qwen/Qwen3-1.7B                    # --preset quick: an afternoon on one node
#   bash ablation.sh --model Qwen/Qwen3-4B --preset paper       # the paper's sizes (8B too)
#   bash ablation.sh --model DIR --data rows.jsonl --tb2 DIR --aider DIR --rl-tasks DIR --offline-images
#                                 # offline: local paths, and the task images that are here (the stand-in)
#   bash ablation.sh --model tiny # the same on CPU: a tiny random Qwen3, the fixture rows and tasks (CI's rehearsal)
# RL and evaluation prompt the policy as its SFT rows were written (--prompt-template rows, the default), with Harbor's
# current Terminus-2 template (harbor) or a file's; task images are the benchmarks' own, pulled, unless
# --offline-images
#
# Re-running resumes: every stage skips or continues when its output exists. settings.json in the run folder
# records every size and the seed; a run folder is only continued with the same ones, or with more: the settings
# of a stage it did not have, the comparisons of --all, more λ-sweep arms; only their stages then run.
set -Eeuo pipefail
# A run that stops early says where: the line, the command and its exit status (set -e alone ends without a word);
# -E: inside functions too. A stage's own failure is named by stage() with its command expanded.
trap 'echo "${BASH_SOURCE[0]}: line $LINENO: exit $?: $BASH_COMMAND" >&2' ERR
# Stopped (Ctrl-C, kill): the stage's Python process unwinds first (its sandboxes removed), then the run says so
trap 'echo "ablation.sh: stopped by SIGINT; run it again to continue where it stopped" >&2; exit 130' INT
trap 'echo "ablation.sh: stopped by SIGTERM; run it again to continue where it stopped" >&2; exit 143' TERM
cd "$(dirname "$0")"
# bash 5.1: spread() below waits for the first of its evaluations with `wait -n -p` (Debian 12 has 5.2)
if ((BASH_VERSINFO[0] < 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] < 1))); then
    echo "ablation.sh needs bash 5.1 or newer; this is $BASH_VERSION" >&2; exit 2
fi
USAGE="usage: bash ablation.sh [--quick] [--all] [--sweep[=λ,λ,...]]
       bash ablation.sh --model ID|DIR|tiny [--preset quick|paper] [--all] [--sweep[=...]] [--data ROWS]
                        [--tb2 DIR] [--aider DIR] [--rl-tasks DIR] [--prompt-template rows|harbor|FILE]
                        [--network egress|host|none] [--offline-images]"
MODE=full LAMBDAS='' ALL='' MODEL='' PRESET='' NETWORK=unset OFFLINE_IMAGES=''
declare -A INPUT=()  # scripts/fetch.py's flags: --data, --tb2, --aider, --rl-tasks, --prompt-template
while [ $# -gt 0 ]; do
    case $1 in
        --quick) MODE=quick ;;
        --all) ALL=1 ;;
        --sweep) LAMBDAS=default ;;
        --sweep=*) LAMBDAS=${1#--sweep=} ;;
        --offline-images) OFFLINE_IMAGES=1 ;;
        --model|--preset|--data|--tb2|--aider|--rl-tasks|--prompt-template|--network)
            [ $# -ge 2 ] || { echo "$1 needs a value" >&2; echo "$USAGE" >&2; exit 2; }
            case $1 in
                --model) MODEL=$2 ;;
                --preset) PRESET=$2 ;;
                --network) [[ $2 =~ ^(egress|host|none)$ ]] || { echo "--network: egress, host or none" >&2; exit 2; }
                           NETWORK=${2/#none/} ;;
                *) INPUT[$1]=$2 ;;
            esac
            shift ;;
        *) echo "$USAGE" >&2; exit 2 ;;
    esac
    shift
done
for L in ${LAMBDAS//,/ }; do  # before anything is installed: a mistyped λ stops the run at once
    [[ $L = default || $L =~ ^(0?\.[0-9]+|[01](\.0*)?)$ ]] || { echo "--sweep: $L is not a λ in [0, 1]" >&2; exit 2; }
done
[[ ${SEED:-0} =~ ^[0-9]+$ ]] || { echo "SEED=$SEED: the seed is a non-negative integer" >&2; exit 2; }
if [ -n "$MODEL" ]; then
    [ $MODE = quick ] && { echo "--quick is the CPU world's; with --model pick a --preset" >&2; exit 2; }
    [ -n "$PRESET" ] || { [ "$MODEL" = tiny ] && PRESET=rehearsal || PRESET=quick; }
    [[ $PRESET =~ ^(quick|paper|rehearsal)$ ]] || { echo "--preset $PRESET: quick, paper or rehearsal" >&2; exit 2; }
    MODE=real
elif [ -n "$PRESET" ] || [ ${#INPUT[@]} != 0 ] || [ "$NETWORK" != unset ] || [ -n "$OFFLINE_IMAGES" ]; then
    echo "--preset, --data, --tb2, --aider, --rl-tasks, --prompt-template, --network and --offline-images go with" \
        "--model" >&2; exit 2
fi
export PYTHONUNBUFFERED=1  # each stage's lines as they come, also into a file (`bash ablation.sh > log`)
. .ci/setup.sh  # installs, starts Docker (and stops it on exit if it was not up), builds the base image

# ---- settings: full, then what --quick shrinks ------------------------------------------------------------
SEED=${SEED:-0}
# SFT arms; the first is the baseline of every comparison in the report. The main job is the paper's comparison
# (ActionSFT against ActObs), sized to fit 2 hours on 2 AVX2 cores in fp32 (measured: RESULTS.md); --all adds
# Obs→Act: one observation-only epoch, then one action-only epoch: in the full run the same passes over the data and
# steps as the other arms (sft.py counts --epochs per phase)
ARMS=(actionsft actobs)
if [ -n "$ALL" ]; then ARMS+=(obs-then-act); fi
declare -A LOSS=([actionsft]="--lam 0" [actobs]="--lam 1" [obs-then-act]="--schedule obs-then-act --epochs 1")
BASE=(--sessions 256 --heldout 16 --commands 20 --epochs 6 --batch-size 2 --lr 1e-3)      # scripts/base_model.py
CORPUS=(--n-sft 576 --n-rl 32 --n-eval 36)                                                # envs.py corpus
HELDOUT_N=32                                                                              # trajectories for the probes
# --micro-tokens 1: a forward pass per trajectory. On CPU a padded batch of a step's 4 trajectories is no faster a
# token than one row, and ~20 % of its tokens would be padding: 0.77x the step time of a padded batch
# (bench/sft_micro.py)
# Every stage computes in --dtype auto (common.resolve_dtype): bf16 only where it is faster than fp32 (CUDA, a CPU with
# native bf16), fp32 on a CPU that emulates it (15-45x slower there); report.py settings prints the choice once
SFT=(--lr 2e-3 --warmup-ratio 0.05 --min-lr-ratio 0.1 --batch-size 4 --epochs 2 --max-len 3072 --micro-tokens 1
     --val-size 16 --eval-every 0 --save-every 40 --keep 1 --probe-every 40)  # sft.py, all arms
# RL and evaluation roll out with the same limits; the expert needs ~5 turns of ~80 tokens, but its csv_summary script
# reply is up to ~330 (`report.py limits` checks the corpus against these). One engine step decodes a token for every
# live episode, so 32 sandboxes at once cost little more per step than 8. --micro-tokens 1: the update forwards one
# episode a pass (padded micro-batches take 1.4-3.2x the update's time on CPU: bench/grpo_micro.py). lr 1e-4 with a
# k3 KL to the SFT policy (0.05): lr 1e-5 moves the policy nowhere, 3e-4 and above break its JSON replies within
# 8 steps (RESULTS.md has the runs); 8 steps are what the time budget leaves. --redraw 2: the last two steps draw the
# first two's tasks, so the report's first-vs-last solve rate compares the same tasks (the draw alone moves that z by
# ~1.7 standard deviations: bench/draw_noise.py). The toy world's tight episode limits, 10 turns and 3 parse errors in
# a row, and an episode that fills --max-len ending there (--no-summarize), are passed here: grpo.py and evaluate.py
# default to Harbor's Terminus-2 (neither limit, the task's agent timeout; a hand-off to a new context at --max-len)
GRPO=(--steps 8 --tasks-per-step 4 --group-size 8 --lr 1e-4 --kl-coef 0.05 --scale-std --redraw 2 --max-turns 10
      --max-parse-errors 3 --no-summarize --max-new-tokens 384 --max-len 4096 --concurrency 32 --micro-tokens 1
      --save-every 4 --keep 1)                                                                             # grpo.py
# 36 evaluation tasks (4 of each kind) x 4 attempts: more tasks rather than more attempts, as the pass@1 interval is
# bounded by how much tasks differ more than by the attempts on each (8 attempts: pass@8, ~7 more minutes an arm)
EVAL=(--attempts 4 --max-turns 10 --max-parse-errors 3 --no-summarize --max-new-tokens 384 --max-len 4096
      --concurrency 64)                                                                   # evaluate.py, all models
# The GRPO'd policies are the comparison at pass@n; the SFT checkpoints are compared at pass@1-2 (that they look
# alike, and what GRPO did to each), and the base only shows that it solves ~nothing: they get 2 attempts and 1
EVAL_SFT=(--attempts 2)
EVAL_BASE=(--attempts 1)
PROBE=(--n 32 --max-len 3072)                                                             # probes.py
SAMPLE=(--max-new-tokens 128)                                                             # probes' own samples
if [ $MODE = quick ]; then
    BASE=(--sessions 8 --heldout 2 --commands 6 --epochs 1 --batch-size 4 --lr 2e-3 --hidden 64 --layers 2 --heads 2
          --kv-heads 1
          --vocab 1024 --max-len 1024 --copy-steps 4 --copy-schedule "16:2,32:0" --refresh-steps 4)
    CORPUS=(--n-sft 20 --n-rl 2 --n-eval 2)
    HELDOUT_N=4
    SFT=(--lr 2e-3 --batch-size 4 --epochs 1 --max-len 1024 --micro-tokens 1 --val-size 4 --eval-every 0
         --save-every 0 --keep 1 --probe-every 2)
    GRPO=(--steps 2 --tasks-per-step 1 --group-size 2 --lr 1e-4 --kl-coef 0.05 --scale-std --redraw 1 --max-turns 2
          --max-parse-errors 3 --no-summarize --max-new-tokens 48 --max-len 1024 --concurrency 2 --micro-tokens 1
          --save-every 1 --keep 1)
    EVAL=(--attempts 2 --max-turns 2 --max-parse-errors 3 --no-summarize --max-new-tokens 48 --max-len 1024
          --concurrency 4)
    EVAL_SFT=(--attempts 2)
    EVAL_BASE=(--attempts 1)
    PROBE=(--n 4 --max-len 1024)
    SAMPLE=(--max-new-tokens 32)
fi
# A real model: the same arms, comparisons and recipe, the preset's sizes. GRPO as the paper's (no KL term: no
# initial policy is held); episodes as Harbor's Terminus-2 runs them (no turn cap, parse errors never end one: the
# flags' defaults; the CPU rehearsal keeps 2 turns); the tasks that allow the internet (Endless Terminals' verifiers
# fetch uv) get it through the egress network (the internet, nothing of the node's: docs/sandboxes.md; a node that
# cannot have it stops the run here), not the rehearsal's
if [ $MODE = real ]; then
    HELDOUT_N=256 SAMPLE=(--max-new-tokens 1024) FETCH_MORE=()
    [ "$NETWORK" = unset ] && { [ "$PRESET" = rehearsal ] && NETWORK='' || NETWORK=egress; }
    # made (or refused, saying why) now, not after hours of SFT
    [ "$NETWORK" != egress ] || python -c 'from actobs.sandbox import network; network.ensure()'
    case $PRESET in
        quick)  # an afternoon on one 8-GPU node: a small Qwen3, 4,000 rows, 20 GRPO steps, 4 attempts a task
            ROWS=4000
            SFT=(--lr 1e-5 --warmup-ratio 0.05 --batch-size 64 --epochs 1 --max-len 16384 --micro-tokens 16384
                 --val-size 64 --eval-every 0 --save-every 50 --keep 1)
            GRPO=(--steps 20 --tasks-per-step 16 --group-size 8 --lr 1e-6 --redraw 2
                  --max-new-tokens 4096 --max-len 32768 --micro-tokens 32768 --concurrency 32 --save-every 10 --keep 1)
            EVAL=(--attempts 4 --max-new-tokens 4096 --max-len 32768 --concurrency 32)
            EVAL_SFT=(--attempts 4) EVAL_BASE=(--attempts 2) PROBE=(--n 256 --max-len 16384) ;;
        paper)  # the paper's: 50k rows (its SFT set), 135 GRPO steps of 32 tasks x 16 (grpo.py's defaults), 16
            # attempts a task
            ROWS=50000
            SFT=(--lr 1e-5 --warmup-ratio 0.05 --batch-size 64 --epochs 1 --max-len 16384 --micro-tokens 16384
                 --val-size 256 --eval-every 200 --save-every 200 --keep 2)
            GRPO=(--steps 135 --tasks-per-step 32 --group-size 16 --lr 1e-6 --redraw 4
                  --max-new-tokens 4096 --max-len 16384 --micro-tokens 16384 --concurrency 64 --save-every 10 --keep 2)
            EVAL=(--attempts 16 --max-new-tokens 8192 --max-len 40960 --concurrency 32)
            EVAL_SFT=(--attempts 16) EVAL_BASE=(--attempts 16) PROBE=(--n 256 --max-len 16384) ;;
        rehearsal)  # on CPU: a tiny random Qwen3, the fixtures' 3 rows and tasks, a step or two of everything; offline:
            # the stand-in images; every solvable RL task trains (a set with one still rehearses)
            ROWS=2 HELDOUT_N=1 SAMPLE=(--max-new-tokens 32) OFFLINE_IMAGES=1 FETCH_MORE=(--rl-heldout 0)
            SFT=(--lr 2e-3 --batch-size 1 --epochs 1 --max-len 4096 --micro-tokens 1 --val-size 1 --eval-every 0
                 --save-every 0 --keep 1 --probe-every 1)
            GRPO=(--steps 2 --tasks-per-step 1 --group-size 2 --lr 1e-4 --scale-std --redraw 1 --max-turns 2
                  --max-new-tokens 48 --max-len 4096 --concurrency 2 --micro-tokens 1 --save-every 1 --keep 1)
            EVAL=(--attempts 2 --max-turns 2 --max-new-tokens 48 --max-len 4096 --concurrency 4)
            EVAL_SFT=(--attempts 2) EVAL_BASE=(--attempts 1) PROBE=(--n 1 --max-len 4096)
            F=tests/fixtures
            for k in --data=$F/nemotron_terminal_sample.json --tb2=$F/tb2-tasks --aider=$F/aider --rl-tasks=$F/harbor
            do [ -n "${INPUT[${k%%=*}]:-}" ] || INPUT[${k%%=*}]=${k#*=}; done ;;
    esac
    # Sampling as the paper's, every preset: GRPO's rollouts at T 0.6 (the paper's RL temperature as a published
    # summary of it gives; top-p 1 and top-k off, so the trainer's log-probs, of logits / T, are the distribution
    # sampled); evaluations at Qwen3's recommended thinking-mode sampling (T 0.6, top-p 0.95, top-k 20), colder than
    # the paper's T* = 0.64, to which it raised ActionSFT + GRPO's evaluation (--all: T* replaces the temperature)
    GRPO+=(--temperature 0.6) EVAL+=(--temperature 0.6 --top-p 0.95 --top-k 20)
    IMAGES=own; [ -z "$OFFLINE_IMAGES" ] || IMAGES=standin  # the report says which
    FETCH=(--model "$MODEL" --seed "$SEED" --rows "$ROWS" --heldout "$HELDOUT_N" ${NETWORK:+--network "$NETWORK"}
           ${OFFLINE_IMAGES:+--offline-images} "${FETCH_MORE[@]}")
    for k in --data --tb2 --aider --rl-tasks --prompt-template; do
        [ -z "${INPUT[$k]:-}" ] || FETCH+=("$k" "${INPUT[$k]}")
    done
    NET=(${NETWORK:+--network "$NETWORK"})  # grpo.py's and evaluate.py's
fi
# The comparisons beyond the SFT arms: ECHO (--all: grpo.py's observation loss on the policy's own rollouts, at the
# weight of its reference setting), T* (--all) and the λ sweep's values (--sweep without a list)
ECHO=() TSTAR=
if [ -n "$ALL" ]; then ECHO=(--echo-coef 0.05) TSTAR=1; fi
SWEEP=(0.25 0.5)
if [ $MODE = quick ]; then SWEEP=(0.5); fi
[ "$LAMBDAS" = default ] && LAMBDAS="${SWEEP[*]}"
SWEEP_ARMS=()  # an SFT arm per λ, through the same GRPO and evaluation as the others
for L in ${LAMBDAS//,/ }; do SWEEP_ARMS+=("lam$L"); LOSS[lam$L]="--lam $L"; done
R=runs/ablation
if [ $MODE = quick ]; then R=runs/ablation-quick; fi
if [ $MODE = real ]; then R=runs/real-$PRESET; fi
R=${RUN_DIR:-$R}
# The system prompt of the toy corpus's tasks, RL's and evaluation's; a real run's RL and evaluation take the one its
# rows were written with (or --prompt-template's), which scripts/fetch.py writes into the run folder
PT=scripts/toy_prompt.txt PTF=(--prompt-template scripts/toy_prompt.txt)
if [ $MODE = real ]; then PT=$R/prompt_template.txt PTF=(--prompt-template "$PT"); BASE=(); CORPUS=("${FETCH[@]}"); fi
mkdir -p "$R/eval" "$R/probes"
if [ $MODE = real ]; then mkdir -p "$R/eval/aider"; else NET=(); fi
ARM_LOSS=(); for A in "${ARMS[@]}" "${SWEEP_ARMS[@]}"; do ARM_LOSS+=("loss_$A=${LOSS[$A]}"); done
python -m scripts.report settings "$R" mode="$MODE" seed="$SEED" prompt_template="$PT" base="${BASE[*]}" \
    corpus="${CORPUS[*]}" heldout_n=$HELDOUT_N arms="${ARMS[*]}" sweep_arms="${SWEEP_ARMS[*]}" "${ARM_LOSS[@]}" \
    sft="${SFT[*]}" grpo="${GRPO[*]}" echo="${ECHO[*]}" tstar="$TSTAR" eval="${EVAL[*]}" eval_sft="${EVAL_SFT[*]}" \
    eval_base="${EVAL_BASE[*]}" probe="${PROBE[*]}" sample="${SAMPLE[*]}" \
    ${PRESET:+preset="$PRESET" model="$MODEL" network="$NETWORK" images="$IMAGES"}
# The stages in order, for the banners: a stage whose output exists is skipped (its banner too)
STAGES=(base corpus sft eval-sft probes-sft grpo eval-grpo)
if [ -n "$TSTAR" ]; then STAGES+=(probes-tstar eval-tstar); fi
STAGES+=(report)
# banner NAME: which stage starts, of how many, and the run's time so far
banner() {
    local i n=${#STAGES[@]}
    for i in "${!STAGES[@]}"; do [ "${STAGES[$i]}" = "$1" ] && break; done
    printf '\n==> stage %d/%d: %s | %s | %dm%02ds into the run\n' $((i + 1)) "$n" "$1" "$(date +%H:%M:%S)" \
        $((SECONDS / 60)) $((SECONDS % 60))
}
# stage NAME CMD...: run CMD, append its wall time to $R/times.jsonl; a failure names the stage, its command and the
# line of ablation.sh that ran it
stage() {
    local t=$SECONDS rc=0
    banner "$1"
    "${@:2}" || rc=$?
    if [ $rc != 0 ]; then
        echo "ablation.sh: line ${BASH_LINENO[-2]}: stage $1 failed (exit $rc) after $((SECONDS - t))s: ${*:2}" >&2
        exit $rc
    fi
    echo "{\"stage\": \"$1\", \"seconds\": $((SECONDS - t))}" >> "$R/times.jsonl"
}
# Runs of one script share a process (common.run_cli: `:::` between their arguments): a CPU process spends ~9 s
# importing torch, transformers and vLLM before any work, and a run samples and trains in a shared process as alone.
# together NAME SCRIPT: run the runs collected in RUNS (each added as `::: ARGS...`) as stage NAME; empties RUNS
RUNS=()
together() { [ ${#RUNS[@]} = 0 ] || stage "$1" python "$2" "${RUNS[@]:1}"; RUNS=(); }
# On GPUs, a training stage runs each of RUNS under torchrun over every GPU, with the plan's memory flags (trained),
# and an evaluation stage one process a run, as many at once as there are GPUs, each on its own (evaluated)
each() {
    local script=$1 args=() a; shift
    for a in "$@" :::; do
        if [ "$a" != ::: ]; then args+=("$a"); elif [ ${#args[@]} != 0 ]; then
            torchrun --standalone --nproc_per_node "$GPUS" "$script" "${args[@]}" "${MEM[@]}" || return; args=()
        fi
    done
}
spread() {
    local script=$1 args=() a gpu rc=0 finished=''; local -A on=(); shift
    for a in "$@" :::; do
        if [ "$a" != ::: ]; then args+=("$a"); continue; fi
        [ ${#args[@]} = 0 ] && continue
        if [ ${#on[@]} = "$GPUS" ]; then wait -n -p finished "${!on[@]}" || rc=$?; unset "on[$finished]"; fi
        for gpu in "${VISIBLE[@]}"; do [[ " ${on[*]} " = *" $gpu "* ]] || break; done
        CUDA_VISIBLE_DEVICES=$gpu python "$script" "${args[@]}" & on[$!]=$gpu
        args=()
    done
    while [ ${#on[@]} != 0 ]; do wait -n -p finished "${!on[@]}" || rc=$?; unset "on[$finished]"; done
    return $rc
}
trained() { if [ "$GPUS" = 0 ]; then together "$@"; elif [ ${#RUNS[@]} != 0 ]; then
    stage "$1" each "$2" "${RUNS[@]}"; RUNS=(); fi; }
evaluated() { if [ "$GPUS" = 0 ]; then together "$1" evaluate.py; elif [ ${#RUNS[@]} != 0 ]; then
    stage "$1" spread evaluate.py "${RUNS[@]}"; RUNS=(); fi; }

GPUS=$(python -c 'import torch; print(torch.cuda.device_count())')  # torchrun's ranks (0: the CPU, one process)
# A driver older than the CUDA build of the pinned torch leaves torch without a GPU while nvidia-smi answers: stop
# rather than run the CPU branch on a GPU node
if [ "$GPUS" = 0 ] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    echo "ablation.sh: nvidia-smi sees GPUs (driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader \
        | head -1)) but torch $(python -c 'import torch; print(torch.__version__, "built for CUDA", torch.version.cuda)'
        ) sees none: install the driver that CUDA build needs (CUDA 13.0: 580 or newer)" >&2
    exit 1
fi
# The GPUs this job was given (a scheduler's CUDA_VISIBLE_DEVICES: indices or UUIDs), else all: one evaluation on each
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=, read -r -a VISIBLE <<< "$CUDA_VISIBLE_DEVICES"
else VISIBLE=(); for ((i = 0; i < GPUS; i++)); do VISIBLE+=("$i"); done; fi
if [ $MODE = real ]; then STAGES=(fetch plan "${STAGES[@]:2}"); fi
if [ "$GPUS" != 0 ]; then STAGES=(gpu-check "${STAGES[@]}"); fi
# On a GPU: bench.gpu_check first (the CUDA paths CPU CI cannot run); a failed check stops the run with its line
if [ "$GPUS" != 0 ] && [ ! -f "$R/gpu_check.ok" ]; then
    stage gpu-check python -m bench.gpu_check
    touch "$R/gpu_check.ok"
fi
if [ $MODE = real ]; then
    # ---- 1-2. the inputs: the model, the rows (the probes' held out), the task sets, the RL tasks' solvable split
    # offline only: a Debian stand-in tagged as the FROM images of Terminal-Bench's and Endless Terminals' tasks;
    # otherwise the fetch pulls the benchmarks' own
    [ -z "$OFFLINE_IMAGES" ] || python envs.py base-image --standin >/dev/null
    [ -f "$R/tasks/rl/oracle.tsv" ] || stage fetch python -m scripts.fetch "$R" "${FETCH[@]}"
    B="$R/base/model"
    banner plan
    MEM=$(python -m scripts.plan "$R")  # the plan on stderr; the training stages' memory flags (GPUs) on stdout
    read -r -a MEM <<< "$MEM"
    EVAL_SETS=(tb2 aider)  # Terminal-Bench 2.0 (the tables' split) and aider-polyglot (by language)
else
    # ---- 1. base model: generic terminal sessions recorded in sandboxes -> BPE -> pre-trained small Qwen3 (cached)
    stage base python -m scripts.base_model --out "$R/base" --seed "$SEED" "${PTF[@]}" "${BASE[@]}"
    B="$R/base/model"

    # ---- 2. corpus: expert episodes on SFT tasks; RL and evaluation tasks are disjoint, `archive` only in eval
    [ -f "$R/corpus/sft.jsonl" ] || stage corpus python envs.py corpus --out "$R/corpus" --seed "$SEED" "${CORPUS[@]}" \
        "${PTF[@]}"
    head -n -$HELDOUT_N "$R/corpus/sft.jsonl" > "$R/train.jsonl"   # the probes' trajectories stay out of SFT
    tail -n $HELDOUT_N "$R/corpus/sft.jsonl" > "$R/heldout.jsonl"
    LIMITS=(); if [ $MODE = quick ]; then LIMITS=(--warn); fi
    python -m scripts.report limits "$R" "${LIMITS[@]}"  # RL / evaluation limits fit the expert
    MEM=() EVAL_SETS=(eval)
fi
RL="$R/corpus/rl"; [ $MODE = real ] && RL="$R/tasks/rl"

# ---- 3. SFT from the same base: same data, order and schedule; only the loss (LOSS above) differs
for A in "${ARMS[@]}" "${SWEEP_ARMS[@]}"; do
    # shellcheck disable=SC2206  # LOSS's values are flag strings: split into their words on purpose
    RUNS+=(::: --model "$B" --data "$R/train.jsonl" --out "$R/$A" --seed "$SEED" --resume "${SFT[@]}" ${LOSS[$A]})
done
trained sft sft.py

# ---- 4. pass@k of the base and each SFT checkpoint on the evaluation split (resumes per attempt); the λ-sweep
# arms are compared after GRPO only
# evaluation M CHECKPOINT [FLAG...]: n attempts per task of each evaluation set, and every episode's conversation to
# read: the toy world's split (eval/M.json), or Terminal-Bench 2.0 (eval/M.json) and aider-polyglot by language
# (eval/aider/M.json)
evaluation() {
    local set out tasks kind
    for set in "${EVAL_SETS[@]}"; do
        out="$R/eval/$1.json" tasks="$R/corpus/eval" kind=()
        [ $MODE = real ] && tasks="$R/tasks/$set"
        [ "$set" = aider ] && out="$R/eval/aider/$1.json" kind=(--kind-by language)
        RUNS+=(::: --model "$2" --tasks "$tasks" --out "$out" --transcripts "${out%.json}.episodes.jsonl" "${PTF[@]}" \
               --seed "$SEED" "${EVAL[@]}" "${NET[@]}" "${kind[@]}" "${@:3}")
    done
}
evaluation base "$B" "${EVAL_BASE[@]}"
for A in "${ARMS[@]}"; do evaluation "$A" "$R/$A/final" "${EVAL_SFT[@]}"; done
evaluated eval-sft

# ---- 5. probes of the SFT checkpoints on held-out trajectories: observation prediction, command entropy, KL from
# the base
S=("${ARMS[@]/#/$R/}"); S=("${S[@]/%//final}")
P=(--data "$R/heldout.jsonl" "${PROBE[@]}")
# probed FILE MODEL...: FILE holds each MODEL's result (an arm that --all adds to a finished run is probed again)
probed() { [ -f "$1" ] && python -c 'import json, sys
sys.exit(any(m not in json.load(open(sys.argv[1])) for m in sys.argv[2:]))' "$@"; }
probed "$R/probes/obs_nll.json" "$B" "${S[@]}" ||
    RUNS+=(::: obs-nll --models "$B" "${S[@]}" "${P[@]}" --out "$R/probes/obs_nll.json")
probed "$R/probes/cmd_entropy.json" "${S[@]}" ||
    RUNS+=(::: cmd-entropy --models "${S[@]}" "${P[@]}" --out "$R/probes/cmd_entropy.json")
probed "$R/probes/kl.json" "${S[@]}" ||
    RUNS+=(::: kl --models "${S[@]}" --init "$B" "${P[@]}" "${SAMPLE[@]}" --out "$R/probes/kl.json")
together probes-sft probes.py

# ---- 6. the same GRPO recipe from each SFT arm and (--all), with ECHO, from ActionSFT (echo-grpo/), on the RL
# split; then pass@k of each GRPO checkpoint
# grpo NAME INIT [FLAG...]: GRPO from INIT into $R/NAME-grpo
grpo() { RUNS+=(::: --init "$2" --tasks "$RL" --out "$R/$1-grpo" "${PTF[@]}" --seed "$SEED" --resume "${GRPO[@]}" \
    "${NET[@]}" "${@:3}"); }
for A in "${ARMS[@]}" "${SWEEP_ARMS[@]}"; do grpo "$A" "$R/$A/final"; done
ECHOS=()
if [ ${#ECHO[@]} != 0 ]; then grpo echo "$R/actionsft/final" "${ECHO[@]}"; ECHOS=(echo); fi
trained grpo grpo.py
for M in "${ARMS[@]}" "${SWEEP_ARMS[@]}" "${ECHOS[@]}"; do evaluation "$M-grpo" "$R/$M-grpo/final"; done
evaluated eval-grpo

# ---- 7. (--all) temperature matching on the GRPO'd policies: ActObs + GRPO's self-entropy at the evaluation
# temperature (the one its evaluation ran at), the T* at which ActionSFT + GRPO's matches it, and ActionSFT + GRPO
# evaluated at T*
# json_field FILE KEY...: one value of a JSON file
json_field() { python -c 'import functools, json, sys
print(functools.reduce(lambda v, k: v[k], sys.argv[2:], json.load(open(sys.argv[1]))))' "$@"; }
if [ -n "$TSTAR" ]; then
    [ -f "$R/probes/entropy_actobs-grpo.json" ] || RUNS+=(::: entropy --model "$R/actobs-grpo/final" \
        --temperature "$(json_field "$R/eval/actobs-grpo.json" settings temperature)" "${P[@]}" "${SAMPLE[@]}" \
        --out "$R/probes/entropy_actobs-grpo.json")
    [ -f "$R/probes/tstar_actionsft-grpo.json" ] || RUNS+=(::: entropy --model "$R/actionsft-grpo/final" \
        --match-entropy "$R/probes/entropy_actobs-grpo.json" "${P[@]}" "${SAMPLE[@]}" \
        --out "$R/probes/tstar_actionsft-grpo.json")
    together probes-tstar probes.py
    evaluation actionsft-grpo-tstar "$R/actionsft-grpo/final" \
        --temperature "$(json_field "$R/probes/tstar_actionsft-grpo.json" t_star)"
    evaluated eval-tstar
fi

# ---- 8. the run folder's REPORT.md, comparison tables and plots; fails if any stage's output is malformed
banner report
python -m scripts.report build "$R"
echo "ablation.sh: done in $((SECONDS / 60))m$((SECONDS % 60))s -> $R/REPORT.md"
