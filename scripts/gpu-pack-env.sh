# Sourced by scripts/gpu-run-packed.sh and scripts/gpu-run-multigpu.sh with $repo, $pack and $out
# set: prepares the device machine for a pack of scripts/gpu-pack.sh and enters its binaries.
# - The binaries name their test data by the absolute path of the build machine's checkout
#   (data_path.txt): make that path lead to this checkout if it does not exist here.
# - The NCCL binaries need libnccl.so.2: the loader's cache, else the copy PyTorch's wheels carry.
# - The binaries are unpacked into a temporary folder, which becomes the current directory.
# Defines log(): a line to the terminal and to $out/summary.txt.
data=$(cat "$pack/data_path.txt")
if [ ! -d "$data" ]; then
  root=$(dirname "$(dirname "$data")")
  mkdir -p "$(dirname "$root")" && ln -sfn "$repo" "$root"
fi
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl.so.2 '; then
  nccl_lib=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null) &&
    export LD_LIBRARY_PATH="$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
bin=$(mktemp -d)
tar -xJf "$pack/bins.tar.xz" -C "$bin"
cd "$bin" || exit 1
log() { echo "$*" | tee -a "$out/summary.txt"; }
log "pack: $(tr '\n' ' ' < "$pack/commit.txt")"
