#!/usr/bin/env bash
# The demo pair's bootstrap drafter (dvi/drafters/), made on a GPU host in one call: `dvi drafter bootstrap` answers the
# corpus with the target in large batches and trains the EAGLE-3 drafter with the trainer (bf16, 8,192 positions a
# step), then this writes what comes back to OUT: the drafter's files (its weights in two pieces: the device tool
# returns files of at most 16 MiB), the report, the log and the GPU's name.
#
#   bash benchmarks/gpu_bootstrap.sh OUT CORPUS GGUF [dvi drafter bootstrap options and overrides...]
#
# CORPUS: a corpus made here (`dvi drafter bootstrap` writes <work>/corpus.jsonl), so that the held-out split is the
# one this machine evaluates; GGUF: the demo target's file. Needs the project's dependencies on PYTHONPATH. Reassemble
# at home with `cat OUT/model.safetensors.* > model.safetensors` and check it against OUT's SHA256SUMS.
set -uo pipefail
OUT=${1:?OUT} CORPUS=${2:?CORPUS} GGUF=${3:?GGUF}
shift 3
WORK=${BOOT_WORK:-/tmp/bootwork}
DRAFTER=${BOOT_DRAFTER:-/tmp/boot/smollm2-eagle3-bootstrap}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DVI_CACHE=${DVI_CACHE:-/tmp/dvi-cache}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; nproc; } > "$WORK.gpu.txt" 2>&1
timeout "${BOOT_TIMEOUT:-540}" python3 -m dvi.cli drafter bootstrap --out "$DRAFTER" --work "$WORK" --corpus "$CORPUS" \
    model.target="$GGUF" tracking.enabled=false "$@" > "$OUT/bootstrap.log" 2>&1
echo "dvi drafter bootstrap: exit $?" >> "$OUT/bootstrap.log"
tail -c 400000 "$OUT/bootstrap.log" > "$OUT/bootstrap.log.tail" && mv "$OUT/bootstrap.log.tail" "$OUT/bootstrap.log"
files=()
for f in "$WORK/bootstrap.json" "$WORK/corpus-manifest.json" "$WORK/answers.progress" "$WORK.gpu.txt"; do
    [ -f "$f" ] && files+=("$f")
done
if [ -f "$DRAFTER/model.safetensors" ]; then
    split -b 15M -d "$DRAFTER/model.safetensors" "$OUT/model.safetensors."
    for f in "$DRAFTER"/*; do
        [ "$(basename "$f")" = model.safetensors ] || files+=("$f")
    done
fi
tar -cf "$OUT/small.tar" --transform 's,.*/,,' "${files[@]}"
ls -la "$OUT"
