"""Training side of dvi: DeepSpeed distillation recipe, losses, replay buffer, triggers, MLflow tracking."""
