"""Generation backends implementing ``aepo_engine.rollout.protocol.GenerationBackend``.

- ``hf.HFBackend``: own sampling loop over a Hugging Face model; exact entropies; CPU or GPU.
- ``vllm.VLLMBackend``: vLLM offline engine; entropies estimated from top-k log-probs.
Import the submodule you need (``vllm`` is optional and heavy).
"""
