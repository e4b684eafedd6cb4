#!/usr/bin/env bash
# Validates docker-compose.yml with `docker-compose config` (Debian's docker-compose package,
# installed here when missing): the schema, variable defaults, that the `cpu` profile adds the
# sluice-cpu service and the `replicas` profile two replicas and nginx. Nothing is built or
# started.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/apt_install.sh docker-compose
docker-compose config -q
expect_services() {  # profile, then the services it must add
  local profile=$1 services
  shift
  docker-compose --profile "$profile" config -q
  services=$(docker-compose --profile "$profile" config --services)
  for service in "$@"; do
    grep -qx "$service" <<<"$services" || {
      echo "check_compose: no service $service with --profile $profile (got: $services)" >&2
      exit 1
    }
  done
}
expect_services cpu sluice sluice-cpu
expect_services replicas sluice-replica-1 sluice-replica-2 sluice-lb
echo "docker-compose.yml: valid ($(docker-compose version --short 2>/dev/null || echo docker-compose))"
