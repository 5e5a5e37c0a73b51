"""pagedattn inside other libraries, each through its own extension points.

- `pagedattn.integrations.transformers`: Hugging Face transformers' `AttentionInterface`
  (`register()` returns the `attn_implementation` name).

Importing this package imports nothing optional; each module imports its library.
"""
