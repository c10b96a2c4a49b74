"""Model code an `open1b export --format hf` directory ships for `transformers` (trust_remote_code)."""
