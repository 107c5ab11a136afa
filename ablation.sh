#!/usr/bin/env bash
# The whole ablation on a CPU machine (root; no GPU, no internet but the Debian and PyPI mirrors): install, build
# the sandbox base image, pre-train a small base model on terminal sessions, generate the toy corpus and disjoint
# RL / evaluation tasks (the held-out kind only in evaluation), SFT three arms from that base (ActionSFT λ=0,
# ActObs λ=1, Obs→Act), the same GRPO recipe from each, pass@k of all seven checkpoints on the held-out tasks,
# the probes, and one run folder with REPORT.md (tables with paired bootstrap intervals) and the plots.
#
#   bash ablation.sh              # the full run -> runs/ablation/     (RUN_DIR=... to write elsewhere)
#   bash ablation.sh --quick      # smaller everything, same code path -> runs/ablation-quick/ (CI runs it)
#
# Re-running resumes: every stage skips or continues when its output exists. settings.json in the run folder
# records every size and the seed; a run folder is only continued with the same ones.
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in "") MODE=full ;; --quick) MODE=quick ;; *) echo "usage: bash ablation.sh [--quick]" >&2; exit 2 ;; esac
. .ci/setup.sh  # installs, starts Docker (and stops it on exit if it was not up), builds the base image

# ---- settings: full, then what --quick shrinks ------------------------------------------------------------
SEED=0
ARMS=(actionsft actobs obs-then-act)  # SFT arms; the first is the baseline of every comparison in the report
declare -A LOSS=([actionsft]="--lam 0" [actobs]="--lam 1" [obs-then-act]="--schedule obs-then-act")
BASE=(--sessions 256 --heldout 16 --commands 16 --epochs 2 --batch-size 2 --lr 2e-3)      # scripts/base_model.py
CORPUS=(--n-sft 576 --n-rl 32 --n-eval 18)                                                # envs.py corpus
HELDOUT_N=32                                                                              # trajectories for the probes
SFT=(--lr 2e-3 --warmup-ratio 0.05 --min-lr-ratio 0.1 --batch-size 4 --epochs 2 --max-len 3072 --micro-tokens 8192
     --dtype bf16 --val-size 16 --eval-every 0 --save-every 40 --keep 1 --probe-every 20)  # sft.py, all arms
# RL and evaluation roll out with the same limits; the expert needs ~5 turns of ~80 tokens, but its csv_summary script
# reply is up to ~330 (`report.py limits` checks the corpus against these). One engine step decodes a token for every
# live episode, so 32 sandboxes at once cost little more per step than 8.
GRPO=(--steps 4 --tasks-per-step 4 --group-size 8 --lr 1e-5 --max-turns 10 --max-new-tokens 384 --max-len 4096
      --concurrency 32 --save-every 4 --keep 1 --kv-cache-gb 1)                            # grpo.py, all arms
EVAL=(--attempts 16 --max-turns 10 --max-new-tokens 384 --max-len 4096 --concurrency 32) # evaluate.py, all models
PROBE=(--n 32 --max-len 3072)                                                             # probes.py
SAMPLE=(--max-new-tokens 128)                                                             # probes' own samples
if [ $MODE = quick ]; then
    BASE=(--sessions 8 --heldout 2 --commands 6 --epochs 1 --batch-size 4 --lr 2e-3 --hidden 64 --layers 2 --heads 2 --kv-heads 1
          --vocab 1024 --max-len 1024)
    CORPUS=(--n-sft 20 --n-rl 2 --n-eval 2)
    HELDOUT_N=4
    SFT=(--lr 2e-3 --batch-size 4 --epochs 1 --max-len 1024 --micro-tokens 8192 --val-size 4 --eval-every 0
         --save-every 0 --keep 1 --probe-every 2)
    GRPO=(--steps 2 --tasks-per-step 1 --group-size 2 --lr 1e-5 --max-turns 2 --max-new-tokens 48 --max-len 1024
          --concurrency 2 --save-every 1 --keep 1 --kv-cache-gb 1)
    EVAL=(--attempts 2 --max-turns 2 --max-new-tokens 48 --max-len 1024 --concurrency 4)
    PROBE=(--n 4 --max-len 1024)
    SAMPLE=(--max-new-tokens 32)
fi
R=${RUN_DIR:-runs/ablation$([ $MODE = quick ] && echo -quick)}
PT=scripts/toy_prompt.txt  # the corpus's short system prompt; RL and evaluation use the same
mkdir -p "$R/eval" "$R/probes"
ARM_LOSS=(); for A in "${ARMS[@]}"; do ARM_LOSS+=("loss_$A=${LOSS[$A]}"); done
python scripts/report.py settings "$R" mode=$MODE seed=$SEED prompt_template=$PT base="${BASE[*]}" corpus="${CORPUS[*]}" \
    heldout_n=$HELDOUT_N arms="${ARMS[*]}" "${ARM_LOSS[@]}" sft="${SFT[*]}" grpo="${GRPO[*]}" eval="${EVAL[*]}" \
    probe="${PROBE[*]}" sample="${SAMPLE[*]}"
# stage NAME CMD...: run CMD, append its wall time to $R/times.jsonl
stage() { local t=$SECONDS; "${@:2}"; echo "{\"stage\": \"$1\", \"seconds\": $((SECONDS - t))}" >> "$R/times.jsonl"; }

# ---- 1. base model: generic terminal sessions recorded in sandboxes -> BPE -> pre-trained small Qwen3 (cached)
stage base python scripts/base_model.py --out "$R/base" --seed $SEED --prompt-template $PT "${BASE[@]}"
B="$R/base/model"

# ---- 2. corpus: expert episodes on SFT tasks; RL and evaluation tasks are disjoint, `archive` only in eval
[ -f "$R/corpus/sft.jsonl" ] || stage corpus python envs.py corpus --out "$R/corpus" --seed $SEED "${CORPUS[@]}" --prompt-template $PT
head -n -$HELDOUT_N "$R/corpus/sft.jsonl" > "$R/train.jsonl"   # the probes' trajectories stay out of SFT
tail -n $HELDOUT_N "$R/corpus/sft.jsonl" > "$R/heldout.jsonl"
python scripts/report.py limits "$R" $([ $MODE = quick ] && echo --warn)  # RL / evaluation limits fit the expert

# ---- 3. SFT from the same base: same data, order and schedule; only the loss (LOSS above) differs
for A in "${ARMS[@]}"; do
    stage sft-$A python sft.py --model "$B" --data "$R/train.jsonl" --out "$R/$A" ${LOSS[$A]} --seed $SEED --resume "${SFT[@]}"
done

# ---- 4. pass@k of the base and each SFT checkpoint on the evaluation split (resumes per attempt)
# evaluate M CHECKPOINT: n attempts per evaluation task, and every episode's conversation to read
evaluate() { stage eval-$1 python evaluate.py --model "$2" --tasks "$R/corpus/eval" --out "$R/eval/$1.json" \
    --transcripts "$R/eval/$1.episodes.jsonl" --prompt-template $PT --seed $SEED "${EVAL[@]}"; }
evaluate base "$B"
for A in "${ARMS[@]}"; do evaluate $A "$R/$A/final"; done

# ---- 5. probes on held-out trajectories: observation prediction, command entropy, KL from the base, and the
# temperature T* at which ActionSFT's self-entropy matches ActObs's
S=("${ARMS[@]/#/$R/}"); S=("${S[@]/%//final}")
P=(--data "$R/heldout.jsonl" "${PROBE[@]}")
[ -f "$R/probes/obs_nll.json" ] || stage probe-obs-nll python probes.py obs-nll --models "$B" "${S[@]}" "${P[@]}" --out "$R/probes/obs_nll.json"
[ -f "$R/probes/cmd_entropy.json" ] || stage probe-cmd-entropy python probes.py cmd-entropy --models "${S[@]}" "${P[@]}" --out "$R/probes/cmd_entropy.json"
[ -f "$R/probes/kl.json" ] || stage probe-kl python probes.py kl --models "${S[@]}" --init "$B" "${P[@]}" "${SAMPLE[@]}" --out "$R/probes/kl.json"
[ -f "$R/probes/entropy_actobs.json" ] || stage probe-entropy python probes.py entropy --model "$R/actobs/final" "${P[@]}" \
    "${SAMPLE[@]}" --out "$R/probes/entropy_actobs.json"
[ -f "$R/probes/tstar_actionsft.json" ] || stage probe-tstar python probes.py entropy --model "$R/actionsft/final" \
    --match-entropy "$R/probes/entropy_actobs.json" "${P[@]}" "${SAMPLE[@]}" --out "$R/probes/tstar_actionsft.json"

# ---- 6. the same GRPO recipe from each SFT arm, on the RL split, then pass@k of each GRPO checkpoint
for A in "${ARMS[@]}"; do
    stage grpo-$A python grpo.py --init "$R/$A/final" --tasks "$R/corpus/rl" --out "$R/$A-grpo" --prompt-template $PT \
        --seed $SEED --resume "${GRPO[@]}"
done
for A in "${ARMS[@]}"; do evaluate $A-grpo "$R/$A-grpo/final"; done

# ---- 7. the run folder's REPORT.md, comparison tables and plots; fails if any stage's output is malformed
python scripts/report.py build "$R"
