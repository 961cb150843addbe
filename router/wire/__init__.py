"""Wire formats: generated protobuf modules (built from proto/ at install), pinned paths, decoders."""
