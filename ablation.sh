#!/usr/bin/env bash
# The main job on a CPU laptop (root; no GPU, no internet): install everything, build the sandbox image,
# generate an SFT corpus by running the scripted expert in real Docker sandboxes, train ActObs (lam=1) and
# ActionSFT (lam=0) from the same tiny random Qwen3, and run the probes on both. Results: runs/ablation/.
#
#   bash ablation.sh                   # RUN_DIR=... to write elsewhere
# Re-running continues where it stopped: the corpus is kept, and training resumes from its checkpoints.
set -euo pipefail
cd "$(dirname "$0")"
. .ci/setup.sh
trap '.ci/dockerd.sh stop' EXIT
R=${RUN_DIR:-runs/ablation}
mkdir -p "$R/probes"

# 1. corpus: expert episodes on SFT tasks; RL and evaluation tasks are disjoint Harbor folders
[ -f "$R/corpus/sft.jsonl" ] || python envs.py corpus --out "$R/corpus" --n-sft 176 --n-rl 32 --n-eval 32 --seed 0
head -n -32 "$R/corpus/sft.jsonl" > "$R/train.jsonl"    # held-out trajectories for the probes
tail -n 32 "$R/corpus/sft.jsonl" > "$R/heldout.jsonl"

# 2. SFT: the two arms differ only in --lam; ActionSFT starts from ActObs's exact initialisation
TRAIN=(--data "$R/train.jsonl" --lr 5e-4 --warmup-ratio 0.1 --batch-size 8 --epochs 2 --max-len 4096
       --micro-tokens 8192 --val-size 16 --eval-every 8 --save-every 8 --keep 100 --probe-every 8)
python sft.py --model tiny --out "$R/actobs" --lam 1 --resume "${TRAIN[@]}"
python sft.py --model "$R/actobs/init" --out "$R/actionsft" --lam 0 --resume "${TRAIN[@]}"

# 3. probes: observation prediction (wrapper vs payload), command-token entropy, KL from the initialisation
P=(--data "$R/heldout.jsonl" --n 32 --max-len 4096)
python probes.py obs-nll --models "$R/actobs/init" "$R/actionsft/final" "$R/actobs/final" "${P[@]}" --out "$R/probes/obs_nll.json"
python probes.py cmd-entropy --models "$R/actionsft/final" "$R/actobs/final" "${P[@]}" --out "$R/probes/cmd_entropy.json"
python probes.py kl --models "$R/actionsft/final" "$R/actobs/final" --init "$R/actobs/init" "${P[@]}" --max-new-tokens 128 \
    --out "$R/probes/kl.json"
echo "done: $R (log.jsonl and probe_geometry.png per arm, probes/*.json and *.png)"
