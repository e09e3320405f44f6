"""moe-pipeline core: recipes, the PR-MoE model, data, the DeepSpeed training loop, run directories. The CLI is cli/."""
