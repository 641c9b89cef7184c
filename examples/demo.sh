#!/usr/bin/env bash
# `make demo`: validate the example fleet and show capability matching with explanations.
# (Later stages of the project grow this into the full fleet loop.)
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "1. Validate the example applications and device capability reports (any spec shape)"
margo validate examples/fleet/apps/*/margo.yaml examples/capabilities/*.json

for app in com-example-gpu-inference com-example-hello-world com-example-line-monitor; do
  step "2. Which devices can run examples/fleet/apps/$app?"
  for caps in examples/capabilities/*.json; do
    device=$(basename "$caps" .json)
    if answer=$(margo match --capabilities "$caps" \
                  --constraints "examples/fleet/apps/$app/margo.yaml"); then
      printf '  %-22s %s\n' "$device" "$answer"
    else
      printf '  %-22s %s\n' "$device" "$(printf '%s' "$answer" | head -1)"
      printf '%s\n' "$answer" | tail -n +2 | sed 's/^/                        /'
    fi
  done
done

step "3. The same answer as JSON, for tools"
margo match --json --capabilities examples/capabilities/k8s-single-arm64.json \
  --constraints examples/fleet/apps/com-example-gpu-inference/margo.yaml || true

demo_dir="$PWD/.demo"   # everything the demo writes lives here (ignored by Git)
rm -rf "$demo_dir" && mkdir -p "$demo_dir"
step "4. Compile the fleet into one Git branch per device ($demo_dir/repos)"
margo compile --source examples/fleet --capabilities examples/capabilities --repos "$demo_dir/repos"

step "5. Why does k8s-single-amd64 not get the GPU application?"
margo explain --device k8s-single-amd64 --intent vision-plant-a \
  --source examples/fleet --capabilities examples/capabilities

step "6. The history of one device's repository"
git --git-dir "$demo_dir/repos/fleet-state.git" log --format='%h %s' devices/k8s-cluster-gpu
git --git-dir "$demo_dir/repos/fleet-state.git" show --stat --format='%B' devices/k8s-cluster-gpu | head -20

printf '\nLook next at: %s/repos/fleet-state.git, examples/fleet/, docs/intents.md\n' "$demo_dir"
