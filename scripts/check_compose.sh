#!/usr/bin/env bash
# Validates docker-compose.yml with `docker-compose config` (Debian's docker-compose package,
# installed here when missing): the schema, variable defaults, and that the `cpu` profile adds
# the sluice-cpu service. Nothing is built or started.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v docker-compose >/dev/null; then
  sudo=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || {
      echo "check_compose: docker-compose is missing; install it as root (no sudo here)" >&2
      exit 1
    }
    sudo="sudo"
  fi
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null
fi
docker-compose config -q
docker-compose --profile cpu config -q
services=$(docker-compose --profile cpu config --services)
for service in sluice sluice-cpu; do
  grep -qx "$service" <<<"$services" || {
    echo "check_compose: no service $service with --profile cpu (got: $services)" >&2
    exit 1
  }
done
echo "docker-compose.yml: valid ($(docker-compose version --short 2>/dev/null || echo docker-compose))"
