#!/usr/bin/env bash
# The main job on a CPU laptop (root; no GPU, no internet): install everything, build the sandbox image,
# pre-train a small base model on generic terminal sessions recorded in real Docker sandboxes, generate an SFT
# corpus by running the scripted expert in sandboxes, train ActObs (lam=1) and ActionSFT (lam=0) from that base,
# run the probes on both and measure pass@k on held-out tasks. Results: runs/ablation/.
#
#   bash ablation.sh                   # RUN_DIR=... to write elsewhere
# Re-running continues where it stopped: the base model and corpus are kept, training resumes from its checkpoints.
set -euo pipefail
cd "$(dirname "$0")"
. .ci/setup.sh
trap '.ci/dockerd.sh stop' EXIT
R=${RUN_DIR:-runs/ablation}
mkdir -p "$R/probes"

# 0. base model: generic terminal sessions recorded in sandboxes -> a BPE fit to them -> a pre-trained 3.8M Qwen3
python scripts/base_model.py --out "$R/base" --sessions 256 --commands 16 --epochs 1 --batch-size 4 --lr 2e-3 --seed 0
B="$R/base/model"

# 1. corpus: expert episodes on SFT tasks; RL and evaluation tasks are disjoint (the `archive` kind only in eval);
# the short prompt of scripts/toy_prompt.txt keeps episodes at ~1k tokens, RL and evaluation must use it too
PT=scripts/toy_prompt.txt
[ -f "$R/corpus/sft.jsonl" ] || python envs.py corpus --out "$R/corpus" --n-sft 320 --n-rl 32 --n-eval 18 --seed 0 \
    --prompt-template $PT
head -n -32 "$R/corpus/sft.jsonl" > "$R/train.jsonl"    # held-out trajectories for the probes
tail -n 32 "$R/corpus/sft.jsonl" > "$R/heldout.jsonl"

# 2. SFT from the base model: the two arms differ only in --lam (same data, init, order and token budget)
TRAIN=(--data "$R/train.jsonl" --lr 2e-3 --warmup-ratio 0.05 --min-lr-ratio 0.1 --batch-size 4 --epochs 1
       --max-len 3072 --micro-tokens 8192 --dtype bf16 --val-size 16 --eval-every 0 --save-every 20 --keep 2 --probe-every 20)
python sft.py --model "$B" --out "$R/actobs" --lam 1 --resume "${TRAIN[@]}"
python sft.py --model "$B" --out "$R/actionsft" --lam 0 --resume "${TRAIN[@]}"

# 3. probes: observation prediction (wrapper vs payload), command-token entropy, KL from the initialisation
P=(--data "$R/heldout.jsonl" --n 32 --max-len 4096)
python probes.py obs-nll --models "$B" "$R/actionsft/final" "$R/actobs/final" "${P[@]}" --out "$R/probes/obs_nll.json"
python probes.py cmd-entropy --models "$R/actionsft/final" "$R/actobs/final" "${P[@]}" --out "$R/probes/cmd_entropy.json"
python probes.py kl --models "$R/actionsft/final" "$R/actobs/final" --init "$B" "${P[@]}" --max-new-tokens 128 \
    --out "$R/probes/kl.json"

# 4. do they act? pass@1 / pass@16 on the evaluation tasks in real sandboxes (the base model: a few attempts)
E=(--tasks "$R/corpus/eval.jsonl" --prompt-template $PT --temperature 1.0 --max-turns 12)
[ -f "$R/act_eval.json" ] || python scripts/act_eval.py --models "$R/actionsft/final" "$R/actobs/final" --attempts 16 "${E[@]}" \
    --out "$R/act_eval.json"
[ -f "$R/act_eval_base.json" ] || python scripts/act_eval.py --models "$B" --attempts 2 "${E[@]}" --out "$R/act_eval_base.json"
echo "done: $R (log.jsonl and probe_geometry.png per arm, probes/*.json and *.png)"
