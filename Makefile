# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# Both build .venv from nothing on a CPU machine and reuse it afterwards.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Free disk a venv built from nothing needs (GB), checked before the install starts.
VENV_FREE_GB ?= 8
# Debian packages the suite drives for real: PostgreSQL (multi-node telemetry),
# Chromium + ChromeDriver (dashboard browser tests) and tcmalloc (the CPU servers' allocator).
DEB_PACKAGES := postgresql chromium chromium-driver libtcmalloc-minimal4

.PHONY: venv system-deps test test-fast demo lint clean

venv: $(STAMP)

$(STAMP): requirements/cpu.lock pyproject.toml
	@# The venv takes about 7.5 GB at its peak: without the room, pip stops halfway with
	@# "No space left on device" and leaves a broken venv, so say so before starting.
	@free=$$(df -Pk . | awk 'NR == 2 {print $$4}'); \
	have=$$(du -sk $(VENV) 2>/dev/null | cut -f1); \
	need=$$(( $(VENV_FREE_GB) * 1048576 - $${have:-0} )); \
	if [ "$$free" -lt "$$need" ]; then \
	  echo "make venv: the virtual environment needs about $$(( need / 1048576 + 1 )) GB more" \
	    "free disk on the file system holding $(CURDIR), which has $$(( free / 1048576 )) GB;" \
	    "free some space, or set VENV_FREE_GB (now $(VENV_FREE_GB)) if you know better" >&2; \
	  exit 1; \
	fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# Disk: torch's wheel links the CUDA libraries (3.4 GB of the 7.2 GB venv) even on a CPU.
	# They go in first, on their own, and no wheel is kept in pip's cache, so their downloaded
	# wheels are gone before the rest arrive (a CI run ran out of disk during the install).
	grep -E '^(nvidia|cuda)-' requirements/cpu.lock > $(VENV)/cuda-libs.txt
	$(BIN)/pip install --disable-pip-version-check --no-cache-dir --no-deps -r $(VENV)/cuda-libs.txt
	$(BIN)/pip install --disable-pip-version-check --no-cache-dir --no-deps -r requirements/cpu.lock
	$(BIN)/pip install --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(BIN)/python -c "import sglang, torch, torchvision, xgboost, flask, plotly, sqlalchemy, alembic; print('venv ok: sglang', sglang.__version__, 'torch', torch.__version__)"
	touch $(STAMP)

system-deps:
	@missing=""; \
	command -v chromium >/dev/null || missing="$$missing chromium chromium-driver"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || missing="$$missing libtcmalloc-minimal4"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(DEB_PACKAGES); \
	fi

# pytest exits 5 when it collects no tests: for this suite that means a broken checkout, so
# it fails `make test` with a message instead of passing silently.
test: venv system-deps
	@$(BIN)/python -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)" >&2; exit 1; fi; \
	exit $$rc

test-fast: venv
	$(BIN)/python -m pytest -m "not slow"

demo: venv system-deps
	$(BIN)/adatree demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
