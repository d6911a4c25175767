"""distill."""
