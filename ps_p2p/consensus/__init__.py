"""consensus."""
