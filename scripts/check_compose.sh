#!/usr/bin/env bash
# Validates docker-compose.yml with `docker-compose config` (Debian's docker-compose package,
# installed here when missing): the schema, variable defaults, and what each profile selects:
# only `sluice` by default, `cpu` adds exactly sluice-cpu, `replicas` exactly two replicas and
# nginx, `gateway` exactly two workers and SMG. Nothing is built or started. (`config
# --services` lists every service whatever the profile, so the selection is read from the
# `profiles:` of the rendered config instead.)
# COMPOSE_FILE, when set, names another file to check (tests/test_deploy_files.py uses it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/apt_install.sh docker-compose
docker-compose config -q
selects() {  # `selects PROFILE SERVICE...`: --profile PROFILE starts exactly these services
  local profile=$1 args=() selected
  shift
  [ -n "$profile" ] && args=(--profile "$profile")
  # A service runs under --profile P when it has no `profiles:` or P is among them. Debian's
  # docker-compose is Python with PyYAML, so python3 can read what it rendered.
  selected=$(docker-compose "${args[@]}" config | python3 -c '
import sys, yaml
profile = sys.argv[1]
services = yaml.safe_load(sys.stdin)["services"]
print(" ".join(sorted(n for n, s in services.items() if profile in s.get("profiles", [profile]))))
' "$profile")
  expected=$(printf "%s\n" "$@" | LC_ALL=C sort | xargs)
  if [ "$selected" != "$expected" ]; then
    echo "check_compose: --profile '${profile}' selects: $selected (expected: $expected)" >&2
    exit 1
  fi
}
selects "" sluice
selects cpu sluice sluice-cpu
selects replicas sluice sluice-replica-1 sluice-replica-2 sluice-lb
selects gateway sluice sluice-worker-1 sluice-worker-2 sluice-gateway
echo "docker-compose.yml: valid ($(docker-compose version --short 2>/dev/null || echo docker-compose))"
