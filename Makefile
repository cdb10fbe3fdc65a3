# Two commands do all the set-up on a fresh machine:
#   make demo   - creates .venv, installs tunepilot (CPU torch), runs the staged pilot on the tiny model
#   make test   - creates .venv, installs tunepilot + test tools, runs lint and the tests
#   make check  - the quick signal: lint and the tests not marked slow
#   make floor  - the same model-building tests on pyproject's lowest torch/transformers/peft
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch, pinned for the test/CI set-up only (the package itself does not pin torch).
TORCH_CPU := torch==2.13.0
# No wheel cache: the set-up writes each wheel once, into the venv (a CI disk once ran out
# during this install with the cache beside it).
PIP_INSTALL := -m pip install -q --no-cache-dir

.PHONY: venv skyvenv browser demo test check floor lint bench clean

$(BIN)/tunepilot: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python $(PIP_INSTALL) --upgrade pip
	$(BIN)/python $(PIP_INSTALL) $(TORCH_CPU)
	$(BIN)/python $(PIP_INSTALL) -e ".[torch,dev,data,hf,trl,lightning]"
	@# byte code for the editable sources, as a wheel install writes it: with
	@# PYTHONDONTWRITEBYTECODE set, every start-up would compile them again (0.1 s of CPU)
	$(BIN)/python -m compileall -q src/tunepilot >/dev/null
	@touch $@

venv: $(BIN)/tunepilot

# SkyPilot in a venv of its own: its pins clash with huggingface-hub's; the launch test runs
# SkyPilot's own task parser (sky.Task.from_yaml) there. No cloud is contacted.
SKY := .venv-sky
$(SKY)/bin/sky:
	$(PY) -m venv $(SKY)
	$(SKY)/bin/python $(PIP_INSTALL) --upgrade pip
	$(SKY)/bin/python $(PIP_INSTALL) "skypilot==0.14.1"
	@touch $@

skyvenv: $(SKY)/bin/sky

demo: venv
	$(BIN)/tunepilot demo

# Headless Chromium for the report's browser test (Debian package; needs root, as CI has).
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || echo "chromium could not be installed: the browser test will skip"

# Two pytest workers (TEST_WORKERS=1 for one), a test file to a worker: the slow tests spend
# much of their time waiting on the torchrun ranks and processes they start.
TEST_WORKERS ?= 2
test: venv browser skyvenv
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The tests not marked slow (no real training run, torchrun group or browser): a quick signal
# for a newcomer; `make test` runs them all.
check: venv
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q -m "not slow"

# The floors: pyproject's lowest torch, transformers and peft (scripts/floors.py reads them) in
# a venv of their own, and the tests that build models and run every objective's step on them.
FLOOR := .venv-floor
FLOOR_TESTS := tests/test_floors.py tests/test_kto_reward.py tests/test_scale_objectives.py \
	tests/test_objective_steps.py::test_dpo_loss_starts_at_its_reference_value_and_trains \
	tests/test_objective_steps.py::test_reference_free_pair_losses_run_without_a_reference \
	tests/test_objective_steps.py::test_a_full_dpo_run_builds_a_frozen_reference_copy \
	tests/test_objective_steps.py::test_grpo_step_generates_then_updates_the_policy
$(FLOOR)/bin/tunepilot: pyproject.toml scripts/floors.py
	$(PY) -m venv $(FLOOR)
	$(FLOOR)/bin/python $(PIP_INSTALL) --upgrade pip
	$(PY) scripts/floors.py | tr ' ' '\n' > $(FLOOR)/floors.txt
	$(FLOOR)/bin/python $(PIP_INSTALL) -c $(FLOOR)/floors.txt -r $(FLOOR)/floors.txt
	$(FLOOR)/bin/python $(PIP_INSTALL) -c $(FLOOR)/floors.txt -e ".[torch,dev]"
	@touch $@

floor: $(FLOOR)/bin/tunepilot
	TUNEPILOT_FLOORS=$(FLOOR)/floors.txt $(FLOOR)/bin/python -m pytest -q -m "not slow" \
		-p no:cacheprovider $(FLOOR_TESTS)

bench: venv
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(SKY) $(FLOOR) runs
