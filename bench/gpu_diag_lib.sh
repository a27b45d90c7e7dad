# Used by bench/gpu_base_diag.sh and bench/gpu_recipe.sh (sourced from the project root, $out set):
# a workspace of the project's own files and a stage run in it, its output in $out/<log>.log.
root=$PWD
copy_project() {  # folder: emptied, then the project without what runs made, results or the wheel folder
  rm -rf "$1" && mkdir -p "$1"
  (cd "$root" && tar --exclude=./.git --exclude=./.whl --exclude=./data --exclude=./models --exclude=./bench/work \
     --exclude=./bench/results --exclude=./metrics --exclude=./reports --exclude=./plots --exclude=./runs \
     -cf - .) | tar -xf - -C "$1"
}
stage() {  # folder, stage, log name
  (cd "$1" && PYTHONPATH=$1/src:$PYTHONPATH python3 -m stages.$2 > "$out/$3.log" 2>&1) || { tail -20 "$out/$3.log"; return 1; }
}
