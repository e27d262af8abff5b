#!/usr/bin/env bash
# Connect Four RL on a multi-host Cloud TPU pod slice (e.g. v5p-32: 4 hosts): the same command on every
# worker VM, joined by jax.distributed's own TPU detection (EARL_DISTRIBUTED=auto).
#
#   TPU_NAME=my-v5p-32 ZONE=us-east5-a launch/tpu_pod.sh --preset qwen0.5b --model.hf-checkpoint /mnt/ckpt/Qwen2.5-0.5B
#
# Set up once (installs the repository on every worker):
#   SETUP=1 REPO_URL=<git url of this repository> TPU_NAME=... ZONE=... launch/tpu_pod.sh
# The run folder should be on storage all hosts see (a GCS-fuse mount or a shared disk) so that orbax
# checkpoints from every host land in one place; process 0 writes metrics and plots.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
PROJECT_FLAG=${PROJECT:+--project=$PROJECT}
REMOTE_DIR="${REMOTE_DIR:-earl-jax}"
RUN_DIR="${RUN_DIR:-runs/connect4-tpu}"

ssh_all() {
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" $PROJECT_FLAG --worker=all --command="$1"
}

if [[ "${SETUP:-0}" == 1 ]]; then
  : "${REPO_URL:?set REPO_URL to the git URL of this repository}"
  ssh_all "set -e; [ -d $REMOTE_DIR ] || git clone $REPO_URL $REMOTE_DIR; cd $REMOTE_DIR && git pull && \
    pip install -q 'jax[tpu]' -f https://storage.googleapis.com/jax-releases/libtpu_releases.html && \
    pip install -q -r requirements.txt && pip install -q -e ."
  exit 0
fi

# Quote the user's flags for the remote shell.
ARGS=$(printf ' %q' "$@")
ssh_all "cd $REMOTE_DIR && EARL_DISTRIBUTED=auto WANDB_MODE=\${WANDB_MODE:-offline} \
  python experiments/connect4.py --run-dir $RUN_DIR $ARGS 2>&1 | tee -a /tmp/earl_connect4.log"
