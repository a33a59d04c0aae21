#!/usr/bin/env bash
# Writes the secrets deploy/kubernetes reads and git never holds, each only when missing:
#   base/core/secrets/nats.env    RLFLEET_NATS_USER, RLFLEET_NATS_PASSWORD (the bus's user)
#   base/lm/secrets/gateway.env   RLFLEET_API_KEY (the OpenAI gateway's key)
# Run it once before `kubectl apply -k deploy/kubernetes/overlays/...`; kustomize refuses to
# render without them, naming the missing file. An existing file is kept, so a re-run never
# changes a password under running pods. Usage: kube-secrets.sh [KUBERNETES_DIR]
set -euo pipefail

kube="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../kubernetes" && pwd)}"

random() {  # 32 random bytes as hex, from the kernel (no openssl needed)
    od -An -N32 -tx1 /dev/urandom | tr -d ' \n'
}

write() {  # write FILE CONTENT: only when FILE is missing, readable by its owner alone
    local file="$1" content="$2"
    if [[ -e "$file" ]]; then
        echo "kube-secrets: keeping $file"
        return
    fi
    mkdir -p "$(dirname "$file")"
    (umask 077 && printf '%s\n' "$content" >"$file")
    echo "kube-secrets: wrote $file"
}

write "$kube/base/core/secrets/nats.env" "RLFLEET_NATS_USER=rlfleet
RLFLEET_NATS_PASSWORD=$(random)"
write "$kube/base/lm/secrets/gateway.env" "RLFLEET_API_KEY=sk-$(random)"
