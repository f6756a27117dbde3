"""Code that runs inside vLLM's worker process (`worker_extension_cls`), reached by collective_rpc.

Why it exists: on the CPU backend every linear layer packs its weight into a kernel-specific copy
after loading. vLLM 0.32's in-place `reload_weights` repacks the layers it reloads, but a
*tied* `lm_head` has no checkpoint tensor of its own, so it is not reloaded and keeps the packed
copy of the *old* embedding: logits come from stale weights while the input embedding is new.
After the reload we repack every head whose weight is shared with another module.
"""

from __future__ import annotations

import torch


def refresh_tied_heads(model: torch.nn.Module) -> int:
    """Re-runs the post-load processing of each lm_head tied to another module; returns how many."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
    )

    other_parameters = {
        id(parameter)
        for module in model.modules()
        if not isinstance(module, ParallelLMHead)
        for parameter in module.parameters(recurse=False)
    }
    refreshed = 0
    for module in model.modules():
        if (
            isinstance(module, ParallelLMHead)
            and isinstance(module.quant_method, UnquantizedEmbeddingMethod)
            and id(module.weight) in other_parameters
        ):
            module.quant_method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


class WeightReloadExtension:
    """Mixed into the vLLM worker class; `self` is the worker."""

    def jaxrlhf_reseed(self, seed: int) -> None:
        """Re-seeds the RNG the sampler draws from (requests carry no generator of their own)."""
        torch.manual_seed(seed)

    def jaxrlhf_reload_weights(self, weights_path: str) -> int:
        """Reloads every checkpoint tensor in `weights_path` in place; returns tied heads fixed."""
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        return refresh_tied_heads(self.model_runner.get_model())
