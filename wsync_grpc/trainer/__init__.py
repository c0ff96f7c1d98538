"""The trainer side: :class:`~wsync_grpc.trainer.client.TrainerClient` and its results and errors."""
