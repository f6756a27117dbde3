"""Preloaded swaps inside a real vLLM CPU engine (generator_service/updates/worker_preload.py), in a
process of their own: the engine runs in that process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so that
the probe below can read the live model between the worker's RPCs.

- Preloading writes nothing of the live model: every tensor keeps its storage and its values, and
  every packed linear (`cpu_linear`) stays the same object, until the commit.
- The commit copies in place (the same storage, new values) and replaces every packed linear,
  the tied head's included (it stays tied to the embedding).
- Tokens and log-probs after a preloaded swap equal, bit for bit, those after vLLM's in-place
  reload of the same update (the non-preloaded path).
- A preload that fails (a tensor of the wrong shape) is reported and leaves the live model as it
  was; the next preload works.
- A preload fed as the update arrives (`jaxrlhf_begin_preload`, then `jaxrlhf_feed_preload` a few
  tensors at a time, as the server does for a streamed update) loads each layer once all its
  tensors have come, waits for the rest, takes them in any order, and commits the same weights;
  a tensor the update was not to carry fails it.
- Nothing of a preload outlives it: after each commit and drop, and after a failed preload is
  dropped, the only packed linears left in the process are the live model's, with Python's
  cycle collector off (a preload that left a reference cycle behind kept its shadow modules and
  their packed weights until a rare full collection: a worker grew by about the packed model
  at every swap).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_preloading_is_invisible_until_the_commit(tiny_llama, tmp_path):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    result = subprocess.run(
        [sys.executable, __file__, str(tiny_llama), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])

    assert report["preloaded_state"] == "done"
    # Nothing live was written while preloading.
    assert report["while_preloaded"] == report["before"]
    commit = report["after_commit"]
    before = report["before"]
    assert set(commit["pointers"]) == set(before["pointers"])
    assert commit["pointers"] == before["pointers"], "the commit moved a live tensor"
    changed = [n for n in before["sums"] if commit["sums"][n] != before["sums"][n]]
    assert set(changed) == {n for n, size in before["sizes"].items() if size > 0}
    assert before["linears"] and all(
        commit["linears"][name] != before["linears"][name] for name in before["linears"]
    ), "a packed linear was not replaced"
    assert "lm_head" in before["linears"] and commit["tied"]

    assert report["preloaded_greedy"] != report["base_greedy"]
    assert report["preloaded_greedy"] == report["reloaded_greedy"]
    assert report["preloaded_logprobs"] == report["reloaded_logprobs"]  # bit for bit

    assert report["bad_state"] == "failed" and "size" in report["bad_error"]
    assert report["after_bad"] == report["before_bad"]
    assert report["after_bad_greedy"] == report["reloaded_greedy"]
    assert report["next_state"] == "done"

    # Fed as it arrives: nothing loaded while a layer misses a tensor, that layer loaded while
    # the rest has not come, the rest in any order; then it commits as the whole update does.
    assert report["before_a_layer"]["state"] == "running"
    assert report["before_a_layer"].get("layers", 0) == 0
    assert report["after_a_layer"]["state"] == "running"
    assert report["after_a_layer"]["layers"] == 1
    assert report["fed_state"] == "done"
    assert report["fed_greedy"] == report["base_greedy"]
    assert report["unexpected_state"] == "failed"
    assert "unexpected" in report["unexpected_error"]

    # Freed without the cycle collector: only the live model's packed linears are left.
    assert set(report["packed"]) == {"commit", "bad", "dropped", "fed", "unexpected"}
    for moment, packed in report["packed"].items():
        assert packed["live"] == len(before["linears"]), moment
        assert packed["alive"] == packed["live"], f"{moment}: a preload left {packed} alive"


# ---- the probe, run in its own process -------------------------------------------------------


def _snapshot(worker) -> dict:
    """Every live tensor's storage and sum, and every packed linear's identity."""
    import torch

    model = worker.model_runner.get_model()
    tensors = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    return {
        "pointers": {n: t.data_ptr() for n, t in tensors.items() if t.numel()},
        "sums": {
            n: float(t.double().sum()) if t.numel() else 0.0
            for n, t in tensors.items()
            if t.is_floating_point()
        },
        "sizes": {
            n: t.numel()
            for n, t in tensors.items()
            if t.is_floating_point() and not n.endswith(("cos_sin_cache", "_scale", "_scale_float"))
        },
        "linears": {
            n: id(m.cpu_linear) for n, m in model.named_modules() if "cpu_linear" in m.__dict__
        },
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "threads": torch.get_num_threads(),
    }


def _packed_linears(worker) -> dict:
    """How many packed linears (vLLM's `cpu_linear` closures) are alive in the process, even
    as garbage awaiting the cycle collector, and how many of them the live model holds."""
    import gc
    import types

    model = worker.model_runner.get_model()
    alive = {
        id(o)
        for o in gc.get_objects()
        if type(o) is types.FunctionType
        and o.__qualname__.startswith("dispatch_cpu_unquantized_gemm.")
    }
    live = {id(m.cpu_linear) for m in model.modules() if "cpu_linear" in m.__dict__}
    return {"alive": len(alive), "live": len(live & alive)}


def _write(folder, tensors: dict, name: str):
    path = os.path.join(folder, name)
    manifest, position = [], 0
    with open(path, "wb") as file:
        for key, value in tensors.items():
            file.write(value.tobytes())
            manifest.append([key, "float32", list(value.shape), position])
            position += value.nbytes
    return path, manifest


def _probe(model_dir: str, folder: str) -> dict:
    import gc
    import time

    from safetensors.numpy import load_file
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=128,
              worker_extension_cls="generator_service.worker_extension.WeightReloadExtension",
              seed=0)  # fmt: skip
    sampling = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8], [9, 10], [1, 200, 31, 77])]

    def greedy():
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        logprobs = [
            [step[t].logprob for t, step in zip(o.token_ids, o.logprobs, strict=True)]
            for o in (output.outputs[0] for output in outputs)
        ]
        return tokens, logprobs

    def rpc(method, **kwargs):
        return llm.collective_rpc(method, kwargs=kwargs)[0]

    def preload_whole(path, manifest):  # a preload begun with every tensor already in the file
        reason = rpc("jaxrlhf_begin_preload", expected=[entry[0] for entry in manifest])
        assert reason or rpc("jaxrlhf_feed_preload", path=path, tensors=manifest)
        return reason

    def wait():
        while (status := rpc("jaxrlhf_preload_status"))["state"] == "running":
            time.sleep(0.005)
        return status

    base = load_file(os.path.join(model_dir, "model.safetensors"))
    rng = np.random.default_rng(0)
    new = {k: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32) for k, v in base.items()}
    report: dict = {"base_greedy": greedy()[0], "before": llm.collective_rpc(_snapshot)[0]}
    report["packed"] = {}
    gc.disable()  # what a preload leaves behind must be freed without the cycle collector

    def packed(moment):
        report["packed"][moment] = llm.collective_rpc(_packed_linears)[0]

    path, manifest = _write(folder, new, "new")
    assert preload_whole(path, manifest) == ""
    report["preloaded_state"] = wait()["state"]
    report["while_preloaded"] = llm.collective_rpc(_snapshot)[0]
    rpc("jaxrlhf_commit_preloaded")
    rpc("jaxrlhf_drop_preloaded")
    packed("commit")
    report["after_commit"] = llm.collective_rpc(_snapshot)[0]
    report["preloaded_greedy"], report["preloaded_logprobs"] = greedy()

    # The same update by the non-preloaded path, from the base weights.
    base_path, base_manifest = _write(folder, base, "base")
    rpc("jaxrlhf_reload_weights", path=base_path, tensors=base_manifest)
    assert greedy()[0] == report["base_greedy"]
    rpc("jaxrlhf_reload_weights", path=path, tensors=manifest)
    report["reloaded_greedy"], report["reloaded_logprobs"] = greedy()

    # A preload that fails: one tensor whose shape does not fit its parameter.
    bad = dict(new)
    name = next(k for k in bad if k.endswith("mlp.down_proj.weight"))
    bad[name] = np.ascontiguousarray(bad[name][:, :-1])
    bad_path, bad_manifest = _write(folder, bad, "bad")
    report["before_bad"] = llm.collective_rpc(_snapshot)[0]
    assert preload_whole(bad_path, bad_manifest) == ""
    status = wait()
    report["bad_state"], report["bad_error"] = status["state"], status["error"]
    rpc("jaxrlhf_drop_preloaded")
    packed("bad")
    report["after_bad"] = llm.collective_rpc(_snapshot)[0]
    report["after_bad_greedy"] = greedy()[0]
    assert preload_whole(base_path, base_manifest) == ""
    report["next_state"] = wait()["state"]
    rpc("jaxrlhf_drop_preloaded")  # done, dropped uncommitted
    packed("dropped")

    # Preloaded as it arrives: begun knowing only the names, fed a few tensors at a time.
    names = [entry[0] for entry in base_manifest]
    layer = [entry for entry in base_manifest if entry[0].startswith("model.layers.0.")]
    rest = [entry for entry in base_manifest if entry not in layer]
    assert rpc("jaxrlhf_begin_preload", expected=names, preload_id=7) == ""
    assert not rpc("jaxrlhf_feed_preload", path=base_path, tensors=layer, preload_id=6)  # not it
    assert rpc("jaxrlhf_feed_preload", path=base_path, tensors=layer[:1], preload_id=7)
    time.sleep(0.5)
    report["before_a_layer"] = rpc("jaxrlhf_preload_status")
    assert rpc("jaxrlhf_feed_preload", path=base_path, tensors=layer[1:], preload_id=7)
    deadline = time.monotonic() + 60
    while rpc("jaxrlhf_preload_status").get("layers", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    report["after_a_layer"] = rpc("jaxrlhf_preload_status")  # the rest not yet fed
    for part in (rest[len(rest) // 2 :], rest[: len(rest) // 2]):  # in any order
        assert rpc("jaxrlhf_feed_preload", path=base_path, tensors=part, preload_id=7)
    report["fed_state"] = wait()["state"]
    rpc("jaxrlhf_commit_preloaded")
    rpc("jaxrlhf_drop_preloaded")
    packed("fed")
    report["fed_greedy"] = greedy()[0]

    # A tensor the update does not have fails the preload.
    assert rpc("jaxrlhf_begin_preload", expected=names[1:], preload_id=8) == ""
    assert rpc("jaxrlhf_feed_preload", path=base_path, tensors=base_manifest[:1], preload_id=8)
    status = wait()
    report["unexpected_state"], report["unexpected_error"] = status["state"], status["error"]
    rpc("jaxrlhf_drop_preloaded")
    packed("unexpected")
    return report


if __name__ == "__main__":
    print(json.dumps(_probe(sys.argv[1], sys.argv[2])))
