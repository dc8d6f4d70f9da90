"""MLflow tracking: one run per job, spooled locally first so no metric is ever lost."""
