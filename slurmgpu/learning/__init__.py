"""Training, evaluation and the model registry."""
