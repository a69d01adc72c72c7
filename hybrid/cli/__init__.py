"""Console scripts, one per job (llama.cpp style)."""
