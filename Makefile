# The demo end to end on one CPU: demo data -> hidden states -> trained drafter ->
# acceptance table and calibration -> calibrated speculators/vLLM folder with its model
# card. `make demo` after installing (README).
PY ?= .venv/bin/python
DEMO := runs/demo
VERIFIER := configs/demo/verifier
# The Hub name recorded in the export (configs/demo/README.md, "Serve"): `vllm serve
# <folder>` needs a repo id there, while the tensors come from $(VERIFIER).
DEMO_VERIFIER_NAME ?= dspark-jax/demo-verifier

.PHONY: demo demo-online test clean-demo

demo: $(DEMO)/export/README.md
	@cat $(DEMO)/export/README.md

# 0. On a fresh clone: a venv with what the demo needs (the CPU torch first, as .ci/run
# installs it; the tests need more: .ci/run). Skipped when PY names another python.
ifeq ($(PY),.venv/bin/python)
$(PY):
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[extract]"
endif

# 1. Prepared rows + hidden states (PyTorch side, HF transformers on CPU).
$(DEMO)/data/hidden_states/extraction_config.json: | $(PY)
	$(PY) -m launch.prepare_data --model $(VERIFIER) --data configs/demo/conversations.jsonl \
		--output $(DEMO)/data --seq-length 1024 --minimum-valid-tokens 16 --draft-vocab-size 2048
	$(PY) -m launch.extract_hidden_states --backend hf --model $(VERIFIER) \
		--preprocessed-data $(DEMO)/data --target-layer-ids 1 2 3

$(DEMO)/heldout/hidden_states/extraction_config.json: | $(PY)
	$(PY) -m launch.prepare_data --model $(VERIFIER) --data configs/demo/conversations_heldout.jsonl \
		--output $(DEMO)/heldout --seq-length 1024 --minimum-valid-tokens 16
	$(PY) -m launch.extract_hidden_states --backend hf --model $(VERIFIER) \
		--preprocessed-data $(DEMO)/heldout --target-layer-ids 1 2 3

# 2. Train the drafter (configs/demo/train.yaml; resumes if interrupted). The target is
# written only when training completes: an interrupted run exits 130/143, which stops
# make, and the next `make demo` resumes it instead of exporting a partial checkpoint.
$(DEMO)/checkpoints/training_complete: $(DEMO)/data/hidden_states/extraction_config.json
	$(PY) -m dspark_jax.train
	touch $@

# 3. Acceptance tables and confidence calibration of the best checkpoint on held-out
#    conversations (eval/calibration.json: the global temperature the export folds in).
$(DEMO)/eval/summary.json: $(DEMO)/checkpoints/training_complete $(DEMO)/heldout/hidden_states/extraction_config.json
	$(PY) -m dspark_jax.eval --checkpoint $(DEMO)/checkpoints --step best --verifier $(VERIFIER) \
		--total-seq-len 1024 --dataset heldout=$(DEMO)/heldout --output-dir $(DEMO)/eval

# 4. Export the best checkpoint for vLLM 0.33: calibrated confidence head, model card
#    (README.md: training command, specifications, serve commands, acceptance table),
#    checked against the verifier; the check prints the `vllm serve` commands.
$(DEMO)/export/README.md: $(DEMO)/eval/summary.json
	$(PY) -m converters export $(DEMO)/checkpoints $(DEMO)/export --step best \
		--verifier-name $(DEMO_VERIFIER_NAME) --verifier-path $(VERIFIER) \
		--calibration $(DEMO)/eval/calibration.json --eval-dir $(DEMO)/eval --overwrite
	$(PY) -m converters check $(DEMO)/export --verifier $(VERIFIER)

# Optional: the demo drafter trained for one epoch on hidden states generated online
# by launch/serve_hidden_states.py (file transport; no hidden-state file is read).
ONLINE_PORT ?= 8765
demo-online: $(DEMO)/data/hidden_states/extraction_config.json
	mkdir -p $(DEMO)/online
	$(PY) -m launch.serve_hidden_states $(VERIFIER) --target-layer-ids 1 2 3 \
		--port $(ONLINE_PORT) --hidden-states-backend file \
		--hidden-states-path $(DEMO)/online/staging > $(DEMO)/online/server.log 2>&1 & \
	server=$$!; trap 'kill $$server' EXIT; \
	for i in $$(seq 120); do \
		curl -sf http://127.0.0.1:$(ONLINE_PORT)/health && break; \
		kill -0 $$server 2>/dev/null || { cat $(DEMO)/online/server.log; exit 1; }; sleep 1; \
	done; \
	$(PY) -m dspark_jax.train --config configs/demo/train.yaml --on-missing generate \
		--vllm-endpoint http://127.0.0.1:$(ONLINE_PORT)/v1 \
		--hidden-states-path $(DEMO)/online/no_files --epochs 1 \
		--save-path $(DEMO)/online/checkpoints --run-name demo-online

test:
	$(PY) -m pytest -q

clean-demo:
	rm -rf $(DEMO)/checkpoints $(DEMO)/logs $(DEMO)/export $(DEMO)/eval $(DEMO)/online
