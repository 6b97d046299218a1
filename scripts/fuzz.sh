#!/usr/bin/env bash
# Fuzzes usher's parsers: builds the cargo-fuzz targets in fuzz/ and runs
# each for a bounded time, one after another, one process each.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# SECONDS per target (default 60); TARGETs default to all of them. Exits
# non-zero when a target finds a crash, a panic, a leak or an allocation
# over 64 MiB; the input is saved in fuzz/artifacts/<target>/ and is
# replayed with `cargo +nightly fuzz run <target> <file>`.
#
# The seed corpus (fuzz/corpus/<target>/, in git) is only read; what a run
# learns is kept in fuzz/target/grown/<target>/ (not in git) for the next run.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-60}"
shift || true

# cargo-fuzz needs a nightly compiler (sanitizer and coverage flags). The
# machine's nightly toolchain if there is one; else the stable compiler
# with its unstable flags let through.
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    cargo=(cargo +nightly)
else
    echo "fuzz.sh: no nightly toolchain; using stable with RUSTC_BOOTSTRAP=1" >&2
    export RUSTC_BOOTSTRAP=1
    cargo=(cargo)
fi

if ! command -v cargo-fuzz >/dev/null 2>&1; then
    echo "fuzz.sh: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked --version '^0.13'
fi

if [ "$#" -gt 0 ]; then
    targets=("$@")
else
    mapfile -t targets < <("${cargo[@]}" fuzz list)
fi

# -O: optimised; -a: debug assertions (integer overflow panics too);
# AddressSanitizer. One build for all targets.
flags=(-O -a --sanitizer address)
"${cargo[@]}" fuzz build "${flags[@]}"

failed=()
for target in "${targets[@]}"; do
    grown="fuzz/target/grown/$target"
    mkdir -p "$grown" "fuzz/corpus/$target"
    echo "fuzz.sh: $target for ${seconds}s" >&2
    # The grown corpus first: libFuzzer writes new inputs to the first
    # directory only. -malloc_limit_mb: no single allocation may be sized
    # by the input beyond usher's limits (64 KiB for these parsers).
    dict=()
    if [ -f "fuzz/dict/$target.dict" ]; then
        dict=(-dict="fuzz/dict/$target.dict")
    fi
    if ! "${cargo[@]}" fuzz run "${flags[@]}" "$target" "$grown" "fuzz/corpus/$target" -- \
        "${dict[@]}" \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
        -malloc_limit_mb=64 -max_len=8192 -print_final_stats=1 2>"fuzz/target/$target.log"; then
        tail -n 60 "fuzz/target/$target.log" >&2
        failed+=("$target")
    else
        grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb)' \
            "fuzz/target/$target.log" | sed "s/^/  $target /" >&2 || true
    fi
done

passed=$((${#targets[@]} - ${#failed[@]}))
echo "fuzz: ${passed} passed, ${#failed[@]} failed"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "fuzz.sh: findings in: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
    exit 1
fi
