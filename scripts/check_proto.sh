#!/usr/bin/env bash
# The public contract, proto/sluice/v1/*.proto, checked with buf (buf.yaml configures both):
#   lint      the STANDARD rules;
#   breaking  no change that breaks a caller built against the previous commit (HEAD~1, the
#             previous commit of main when CI runs on main): a field renumbered, retyped or
#             removed, an RPC removed, a package moved. Comments and new fields are fine.
# Without a previous commit here (the first commit, or a shallow clone that cannot be deepened)
# there is nothing to compare against: the script says so and checks only the lint.
set -euo pipefail
cd "$(dirname "$0")/.."
BUF=(npx --yes @bufbuild/buf@1.75.0)

echo "== buf lint"
"${BUF[@]}" lint

previous() { git rev-parse --quiet --verify 'HEAD~1^{commit}' >/dev/null; }
if ! previous && [ "$(git rev-parse --is-shallow-repository)" = true ]; then
    # A CI checkout is often one commit deep; one more is all this needs.
    git fetch --quiet --deepen=1 2>/dev/null || true
fi
if ! previous; then
    echo "== buf breaking: skipped, this checkout has no previous commit (HEAD~1) to compare with"
elif ! git cat-file -e 'HEAD~1:buf.yaml' 2>/dev/null; then
    echo "== buf breaking: skipped, the previous commit has no buf.yaml (no contract to keep yet)"
else
    echo "== buf breaking against HEAD~1 ($(git rev-parse --short HEAD~1))"
    "${BUF[@]}" breaking --against '.git#ref=HEAD~1'
fi
