"""Pipeline parallelism: the schedules as data (``schedules``, ``simulate``, ``p2p``, ``nccl_model``, ``validate``) and the stage that runs them (``runner``)."""
