"""Drivers execute plan steps against one engine: Helm, Docker Compose, or a directory."""
