"""The recipe's Hydra sweepers."""
