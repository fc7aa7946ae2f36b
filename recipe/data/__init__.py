"""From documents to packed THD micro-batches: sources, tokenizer, corpus, batching, packing.

Everything here is single-process and knows nothing of ranks beyond the sizes it is given.
"""
