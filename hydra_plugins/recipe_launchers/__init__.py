"""The recipe's Hydra launchers (submitit sweeps sized per job)."""
