"""Ray plumbing: connecting to a cluster, the actor group and its placement group, tasks on devices (``group``)."""
