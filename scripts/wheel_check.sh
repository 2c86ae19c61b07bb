#!/usr/bin/env bash
# Install like a user: build the wheel, install it into a fresh virtualenv
# and run the entry points from outside the repository, so a module the wheel leaves out
# fails here rather than on a user's machine (the test suite imports the editable copy).
#   usage: bash scripts/wheel_check.sh [python]   (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" build' EXIT
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false MINIVLLM_DATA_DIR="$tmp/data"

rm -rf build  # setuptools' in-tree build folder: a stale copy could put deleted modules in the wheel
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$tmp/dist" .
"$PY" -m venv "$tmp/venv"
# NOTE: the dependencies (torch alone is 750 MB) are borrowed read-only from the build
# environment through a .pth file (a folder of links, minus minivllm and pip's own
# packages): installing them again took 10 minutes on a loaded 2-core machine. The wheel
# itself is installed for real, with its entry points; its declared dependencies are
# checked against what is borrowed.
site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir "$tmp/deps"
for entry in "$site"/*; do
    case "$(basename "$entry")" in
        minivllm*|__editable__*|*.pth|pip|pip-*|setuptools|setuptools-*|_distutils_hack) ;;
        *) ln -s "$entry" "$tmp/deps/" ;;
    esac
done
new_site=$("$tmp/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$tmp/deps" > "$new_site/borrowed_deps.pth"
"$tmp/venv/bin/pip" install -q --no-deps "$tmp"/dist/minivllm-*.whl
"$tmp/venv/bin/python" - <<'PY'
from importlib.metadata import requires, version

from packaging.requirements import Requirement

for line in requires("minivllm"):
    req = Requirement(line)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        have = version(req.name)
        assert req.specifier.contains(have, prereleases=True), f"{req}: found {have}"
print("the wheel's dependencies: ok")
PY

cd "$tmp"  # nothing of the repository on sys.path
bin="$tmp/venv/bin"
"$bin/python" -c "import minivllm.tui.widgets, minivllm.kernels; print('imports: ok')"
"$bin/minivllm-chat" --help > /dev/null
echo "minivllm-chat --help: ok"
reply=$(echo "What is the capital of France?" | "$bin/minivllm-chat" --plain --device cpu \
    --max-model-len 512 --temperature 0 --max-tokens 12 2> "$tmp/stderr") || {
    cat "$tmp/stderr" >&2; exit 1; }
case "$reply" in
    *Paris*) echo "minivllm-chat --plain: ok ($reply)" ;;
    *) echo "minivllm-chat --plain: unexpected reply: $reply" >&2; cat "$tmp/stderr" >&2; exit 1 ;;
esac
