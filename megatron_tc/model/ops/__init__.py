"""model/ops."""
