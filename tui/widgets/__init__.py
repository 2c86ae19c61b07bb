"""The chat app's widgets, one module each."""
