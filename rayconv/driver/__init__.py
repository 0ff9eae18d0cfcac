"""The driver: one training job from its settings to ``model.pt`` (``job.fit``)."""
