# The two set-up commands of the README: `make launch` (main job: a local PD deployment)
# and `make test` (tests). `make demo` runs offline generation.
# Each creates .venv and installs what it needs on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: launch demo test lint

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# NOTE: pin torch first: any other request pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# The native kernels of this CPU, built now rather than by the first start.
	$(PY) -m baton warmup
	touch $@

# Optional cross-host transfer engines (docs/design.md §4, the `transfer` extra of
# pyproject.toml); .ci/run calls this after Debian's libibverbs1 (which mooncake loads) is on
# the machine.
# NOTE: nixl-cu12 goes in with --no-deps: its declared dependencies pull a multi-GB CUDA torch.
# NVIDIA Dynamo (baton.integrations.dynamo; pyproject's `dynamo` extra documents the versions):
# ai-dynamo's declared `aisimulate` is a stub sdist that cannot build off NVIDIA's own index
# (and only dynamo.planner imports it), so the two dynamo packages go in with --no-deps and
# their other requirements by name. pydantic stays the project's: ai-dynamo-runtime declares
# <=2.13.5 and runs with the 2.14 installed here (tests/integrations).
.PHONY: dynamo
dynamo: $(STAMP)
	$(PY) -m pip install -q --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
	$(PY) -m pip install -q uvloop==0.23.0 kubernetes==32.0.1 redis==8.2.0 zstandard==0.25.0

# Ray Serve (baton.integrations.ray_serve; pyproject's `ray` extra).
.PHONY: ray
ray: $(STAMP)
	$(PY) -m pip install -q "ray[serve]==2.60.0"

.PHONY: extras
extras: $(STAMP) dynamo ray
	$(PY) -m pip install -q --no-deps nixl-cu12==1.5.1
	$(PY) -m pip install -q mooncake-transfer-engine-non-cuda==0.3.13.post1

launch: $(STAMP)
	$(VENV)/bin/baton launch

demo: $(STAMP)
	$(VENV)/bin/baton generate

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q --durations=15
