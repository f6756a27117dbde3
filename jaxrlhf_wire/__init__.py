"""The wire contract between the learner (`jaxrlhf`) and the generator service
(`generator_service`): both import it, neither owns it, and it imports neither.

- `jaxrlhf_wire.stubs`: the gRPC stubs of protos/generator.proto (`generator_pb2`,
  `generator_pb2_grpc`, `SERVICE_NAME`). They are generated at install time (`make install`, or
  `python -m jaxrlhf_wire.build`), never at import; importing them with stubs missing or built
  from another version of the .proto raises ImportError naming that command.
- `jaxrlhf_wire.chunks`: WeightChunk streams: the encoder (`encode_weight_chunks`), the
  copy-free decoder (`decode_weight_chunk`), chunk and message sizes
  and the channel options both ends use.
- `jaxrlhf_wire.dtypes`: the dtypes a weight may travel in, with their sizes, safetensors codes
  and numpy views.
- `jaxrlhf_wire.files`: the page alignment of tensor regions in shared and update files, and
  the sweeper of files left by dead processes.
- `jaxrlhf_wire.hosts`: the loopback rule, for gRPC targets (learner) and peers (server).
- Here: the readiness line and the metadata keys.

Light on purpose: grpc, protobuf and numpy at most, no JAX, vLLM or torch. This module itself
imports nothing, so that the stub builder runs where no stubs exist yet.
"""

# Printed by the server, followed by its address ("GENERATOR_SERVICE_READY 127.0.0.1:50051"),
# once it serves; whoever starts a server waits for this line.
READY_LINE = "GENERATOR_SERVICE_READY"
# Call metadata that carries the shared secret: `authorization: Bearer <token>`.
AUTH_HEADER = "authorization"
# Initial metadata of every Generate call, sent once the call is admitted between weight swaps:
# the policy version it runs on.
ADMITTED_VERSION_HEADER = "x-jaxrlhf-policy-version"
# How a server swaps weights under running requests (`--swap-mode`, GeneratorStatus.swap_mode)
# and, in "in-flight" mode, what becomes of their KV cache (`--in-flight-kv`). "lora": a server
# started with `--max-lora-rank`, whose updates are LoRA adapters loaded with no pause.
SWAP_MODES = ("drain", "in-flight", "lora")
IN_FLIGHT_KV = ("keep", "recompute")
# The largest adapter ranks a "lora" server can be started with (`--max-lora-rank`: vLLM
# 0.32's LoRAConfig.max_lora_rank takes these alone); it serves adapters of any rank up to it.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
