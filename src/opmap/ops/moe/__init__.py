"""moe op family."""
