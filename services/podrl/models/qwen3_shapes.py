"""Real Qwen3 configurations (the Hugging Face config.json of Qwen/Qwen3-0.6B, -1.7B, -8B).

Benchmarks and GPU tests build random-weight models of these shapes; nothing is downloaded.
"""

QWEN3_SHAPES: dict[str, dict[str, int | bool]] = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 vocab_size=151936, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 vocab_size=151936, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               vocab_size=151936, tie_word_embeddings=False),
}  # fmt: skip
