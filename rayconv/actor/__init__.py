"""The Ray actor ``rayconv.actor.actor.Actor`` and its parts, one concept a file: ``actor`` (the actor's
entry points), ``build`` (``ActorState``, the one object an actor holds, built once by ``build``),
``step`` (the training step in the order it runs), ``batches`` (which micro-batches it reads,
prefetch), ``loss`` (the last stage's loss), ``recipe`` (optimizer groups, fp16 loss scaling, clipping,
the moving average), ``state`` (state and rank files in and out), ``report`` (metrics, trace),
``steptime`` (a step's own time and input stall), ``cuda_graph`` (the whole step as one CUDA graph)."""
