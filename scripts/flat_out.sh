#!/usr/bin/env bash
# Runs a command with OUT pointing at a scratch folder, then copies every file it wrote into the
# real $OUT flat (sub/dir/f.json -> sub_dir_f.json): the device tool brings back only files at the
# top of $OUT, and the phases of scripts/h200_kernels.sh write into subfolders.
#
#   OUT=$OUT bash scripts/flat_out.sh bash scripts/h200_kernels.sh fla
set -uo pipefail
real=${OUT:?set OUT}
scratch=$(mktemp -d /tmp/flat_out.XXXX)
OUT=$scratch "$@"
rc=$?
(cd "$scratch" && find . -type f | while read -r f; do
  f=${f#./}; cp "$f" "$real/${f//\//_}"; done)
exit $rc
