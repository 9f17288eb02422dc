# The demo end to end on one CPU: demo data -> hidden states -> trained drafter ->
# speculators/vLLM folder -> acceptance table. `make demo` after installing (README).
PY ?= .venv/bin/python
DEMO := runs/demo
VERIFIER := configs/demo/verifier

.PHONY: demo test clean-demo

demo: $(DEMO)/eval/summary.json
	@cat $(DEMO)/eval/acceptance.md

# 1. Prepared rows + hidden states (PyTorch side, HF transformers on CPU).
$(DEMO)/data/hidden_states/extraction_config.json:
	$(PY) -m launch.prepare_data --model $(VERIFIER) --data configs/demo/conversations.jsonl \
		--output $(DEMO)/data --seq-length 1024 --minimum-valid-tokens 16 --draft-vocab-size 2048
	$(PY) -m launch.extract_hidden_states --backend hf --model $(VERIFIER) \
		--preprocessed-data $(DEMO)/data --target-layer-ids 1 2 3

$(DEMO)/heldout/hidden_states/extraction_config.json:
	$(PY) -m launch.prepare_data --model $(VERIFIER) --data configs/demo/conversations_heldout.jsonl \
		--output $(DEMO)/heldout --seq-length 1024 --minimum-valid-tokens 16
	$(PY) -m launch.extract_hidden_states --backend hf --model $(VERIFIER) \
		--preprocessed-data $(DEMO)/heldout --target-layer-ids 1 2 3

# 2. Train the drafter (configs/demo/train.yaml; resumes if interrupted).
$(DEMO)/checkpoints/run.yaml: $(DEMO)/data/hidden_states/extraction_config.json
	$(PY) -m dspark_jax.train

# 3. Export the best checkpoint in the format `vllm serve --spec-method dspark` loads.
$(DEMO)/export/config.json: $(DEMO)/checkpoints/run.yaml
	$(PY) -m converters export $(DEMO)/checkpoints $(DEMO)/export --step best \
		--verifier-path $(VERIFIER) --overwrite

# 4. Acceptance tables and confidence calibration on held-out conversations.
$(DEMO)/eval/summary.json: $(DEMO)/export/config.json $(DEMO)/heldout/hidden_states/extraction_config.json
	$(PY) -m dspark_jax.eval --checkpoint $(DEMO)/checkpoints --step best --verifier $(VERIFIER) \
		--total-seq-len 1024 --dataset heldout=$(DEMO)/heldout --output-dir $(DEMO)/eval

test:
	$(PY) -m pytest -q

clean-demo:
	rm -rf $(DEMO)/checkpoints $(DEMO)/logs $(DEMO)/export $(DEMO)/eval
