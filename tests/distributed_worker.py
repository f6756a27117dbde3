"""One process of the two-process JAX test (run by tests/test_sharding.py).

argv: coordinator port, process id, model folder. Prints the losses of 2 train steps as JSON.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

from jaxrlhf.sharding import initialize_distributed  # noqa: E402


def main() -> None:
    port, process_id, model_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    initialize_distributed(f"127.0.0.1:{port}", 2, process_id)
    assert jax.device_count() == 4 and jax.local_device_count() == 2
    from tests.test_sharding import make_batch, train_losses

    batch = make_batch()
    half = len(batch["input_ids"]) // 2
    local = {k: v[process_id * half : (process_id + 1) * half] for k, v in batch.items()}
    losses, checksum = train_losses(model_dir, (1, 2, 2), jax.devices(), local)
    print(json.dumps({"losses": losses, "checksum": checksum}), flush=True)


if __name__ == "__main__":
    main()
