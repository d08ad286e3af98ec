#!/bin/sh
# Bundle what the GPU suite needs beyond the GPU machine's own Python (torch, triton, transformers,
# safetensors, grpcio, aiohttp, prometheus_client, xxhash, pytest are there; nothing can be
# downloaded there). Run on a networked machine; carry the output directory to the GPU machine.
#   $1: output directory (default .gpu-deps)
# - site/: pure-Python wheels (redis client, pytest-timeout) for cp312, added to PYTHONPATH;
# - bin/redis-server: this machine's redis-server, started through its own bundled loader and
#   libraries, so it runs whatever glibc the GPU machine has.
set -eu
OUT=${1:-.gpu-deps}
PIP=${PIP:-.venv/bin/pip}
rm -rf "$OUT"
mkdir -p "$OUT/wheels" "$OUT/site" "$OUT/bin" "$OUT/lib" "$OUT/libexec"
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    -d "$OUT/wheels" redis pytest-timeout
$PIP install -q --no-deps --no-compile --target "$OUT/site" "$OUT"/wheels/*.whl
REDIS=$(command -v redis-server)
cp "$REDIS" "$OUT/libexec/redis-server"
ldd "$REDIS" | awk '/=>/ {print $3} /ld-linux/ {print $1}' | while read -r lib; do cp -L "$lib" "$OUT/lib/"; done
cat > "$OUT/bin/redis-server" <<'WRAP'
#!/bin/sh
HERE=$(cd "$(dirname "$0")/.." && pwd)
exec "$HERE/lib/ld-linux-x86-64.so.2" --library-path "$HERE/lib" "$HERE/libexec/redis-server" "$@"
WRAP
chmod +x "$OUT/bin/redis-server"
"$OUT/bin/redis-server" --version
du -sh "$OUT"
