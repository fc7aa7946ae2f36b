"""The megatron-core GPT the recipe trains: builder, attention backends, MTP, CPU compatibility."""
