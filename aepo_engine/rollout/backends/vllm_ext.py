"""Methods added to every vLLM worker (``LLM(worker_extension_cls=...)``) for weight pushes.

Kept apart from ``vllm.py`` because vLLM imports it by dotted name inside its worker processes,
which must not pay for (or recurse into) the backend module.
"""
from __future__ import annotations


class WeightLoaderExtension:
    """Mixed into vLLM's worker class; ``self.model_runner.model`` is the vLLM model."""

    def aepo_load_weights_from_file(self, path: str) -> int:
        """Load HF-named tensors from a safetensors file into the running model; returns count.

        Goes through vLLM's in-place reload (``Worker.reload_weights``), which runs the model's
        own ``load_weights`` (HF names -> fused qkv_proj / gate_up_proj) and then redoes the
        post-load processing. A plain ``model.load_weights`` is not enough: vLLM-CPU repacks
        linear weights after loading and leaves the original parameters empty. Tensors are
        streamed from the file one at a time.
        """
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            self.reload_weights(weights_iterator=((n, f.get_tensor(n)) for n in names), is_checkpoint_format=True)
        return len(names)
