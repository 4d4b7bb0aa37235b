"""cluster_fl: federated DP fine-tuning of speech-LLMs with component-aware clipping."""

__version__ = "0.1.0"
