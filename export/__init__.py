"""export stage of moe-pipeline (filled by a later issue)."""
