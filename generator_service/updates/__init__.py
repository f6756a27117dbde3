"""A weight update's path through the service, one module per step, in order:

1. receive it:
   - `receive_stream`: UpdateWeights streams, each chunk checked and written as it comes;
   - `receive_shared`: UpdateWeightsShared, a file the learner wrote in the shared folder;
2. `join`: the streams of several senders (a multi-process learner) made one update;
3. `tensors`: what an update must be (names, shapes, dtypes of the served model), and the
   error that refuses one;
4. `assemble`: each chunk checked against those specs and placed;
5. `bytes_file`: the raw file the bytes land in, at each tensor's place;
6. `feed`: each tensor handed on as soon as its bytes are all in (preloading while it arrives);
7. preloading, the new weights converted beside the live ones while generation goes on:
   `engine_preload` (the engine's side: begin, feed, wait, drop), `worker_preload` (inside vLLM's
   worker) and `shadow` (the model's shadow it loads into);
8. `swap`: the pause that puts a preloaded update live, drain or in-flight;
9. `apply`: the update lock, the swap through the engine, the ids the server records.

A malformed update is refused at steps 1-6, before anything live changes; a preload that fails
changes nothing live either.
"""
