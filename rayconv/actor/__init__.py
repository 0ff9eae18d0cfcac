"""The parts of the Ray actor ``rayconv.worker.Worker``, one concept a file: ``build`` (setup),
``step`` (the step program), ``state`` (state and checkpoint shards in and out), ``report`` (metrics)."""
