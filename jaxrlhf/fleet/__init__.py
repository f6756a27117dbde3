"""The learner's side of the generator service: the replicas it talks to and how.

- `pool.GeneratorPool`: Generate fanned out over the live replicas with failover; publishing.
- `delivery.WeightDelivery`: how a version of the weights reaches every live and rejoining
  replica (retries, what each failure means); it sees the replicas through their lifecycle.
- `lifecycle`: each replica live, failed or rejoining; probes, restarts, rejoins.
- `failures`: which gRPC codes mean a replica is down.
- `transport/`: one attempt of one version to a set of replicas, streamed (`stream`) or through
  a same-host shared file (`shared_file`), and the senders of a multi-process learner
  (`senders`).
- `rpc/`: the gRPC client of one replica and the same-host weights file format.
- `service`: starting a generator service process beside the learner.
- `sample.Sample`: one completion as a replica returned it.

The RL loop (`jaxrlhf.rl`) sits above this package; nothing here imports it.
"""
