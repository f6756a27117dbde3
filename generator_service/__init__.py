"""The generator service: a vLLM engine behind gRPC (protos/generator.proto).

Run it with `python -m generator_service --model PATH_OR_NAME --port 50051`. Modules:
`server` (gRPC servicer, health, reflection, shutdown), `engine` (vLLM, version tags, swaps),
`gate` (the readers/writer gate behind exact version tags), `requests` (what a Generate call
may ask for), `updates/` (a weight update's path: received, checked, preloaded, swapped),
`worker_extension` (code run inside vLLM's worker), `auth` (token and TLS). The wire contract
(stubs, chunk format, dtypes, loopback rule, readiness line) is `jaxrlhf_wire`, which the learner
imports too; nothing here imports the learner's `jaxrlhf`.
"""
