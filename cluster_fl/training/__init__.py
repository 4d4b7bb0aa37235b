"""Central training outside the federation: ``pretrain`` (``cluster-fl pretrain CONFIG``) trains a
tiny speech-LLM on the public speakers and writes the checkpoint federated runs start from."""
