"""The model: one code path for every stage (Llama-style decoder, FoX, RoPE scaling, HF interop)."""
