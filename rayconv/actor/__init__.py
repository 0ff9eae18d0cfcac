"""The Ray actor ``rayconv.actor.worker.Worker`` and its parts, one concept a file: ``worker`` (the actor's
entry points), ``build`` (``ActorState``, the one object an actor holds, built once by ``setup``),
``step`` (the training step in the order it runs), ``batches`` (which micro-batches it reads,
prefetch), ``loss`` (the last stage's loss), ``recipe`` (optimizer groups, fp16 loss scaling, clipping,
the moving average), ``state`` (state and checkpoint shards in and out), ``report`` (metrics, trace),
``steptime`` (a step's own time and input stall), ``cuda_graph`` (the whole step as one CUDA graph)."""
