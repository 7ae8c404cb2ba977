"""mla op family."""
